"""Each KV token is written once between prompt and decode (issue 33's byte count).

The KV cache manager counts every byte stored into KV (``kv_meter``): a prompt's KV goes straight into
the pages of the row it decodes in (``paged_prefill``), so the bytes written equal the model's KV bytes
per token times the positions the forwards computed (prefill tokens + decode positions): nothing is
copied for a prompt that misses the cache, for one that hits it (its prefix is read from the tree's
pages), for a fan-out over one cached prefix (read once as the batch's shared prefix), for a batch of
prompts of different lengths (a padded prefill group writes only real positions), for a prompt prefilled
in chunks, or with quantized KV. CI runs this file on both paths (native CPU kernels, and
``PARALLM_BACKEND=cpu-mlx``: MLX ops only, what Metal and CUDA run).
"""

from __future__ import annotations

import pytest

from parallm_engine import Engine


def _counts(engine) -> tuple[int, int, int]:
    """(KV bytes written, prefill tokens, decode positions) so far."""
    kv = engine._scheduler.kv

    def read():
        return kv.meter.written, engine.stats()["prefill_tokens"], kv.meter.decoded

    return engine.run_on_engine_thread(read)


def _run(engine, prompts: list[list[int]], max_tokens: int = 3) -> tuple[int, int, int]:
    """Run ``prompts`` at once; the (written, prefilled, decoded) it took."""
    w0, p0, d0 = _counts(engine)
    handles = [engine.submit(p, max_tokens=max_tokens, temperature=0, ignore_eos=True) for p in prompts]
    for h in handles:
        engine._collect(h)
    w1, p1, d1 = _counts(engine)
    return w1 - w0, p1 - p0, d1 - d0


def _once(engine, written: int, prefilled: int, decoded: int) -> None:
    bpt = engine._scheduler.kv.kv_bytes_per_token
    assert prefilled > 0 and decoded > 0
    assert written == bpt * (prefilled + decoded), (written / bpt, prefilled, decoded)


def _alone(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens run alone on an empty prefix cache (left empty)."""
    out = []
    for p in prompts:
        engine.clear_prefix_cache()
        out.append(engine.generate([p], max_tokens=max_tokens, temperature=0, ignore_eos=True)[0].token_ids)
    engine.clear_prefix_cache()
    return out


def _decoding(engine, prompts: list[list[int]], max_tokens: int):
    """(handles, streams) of ``prompts`` decoding (each has delivered its first token); their prompts are
    then dropped from the prefix cache, so later prompts compute everything."""
    handles = [engine.submit(p, max_tokens=max_tokens, temperature=0, ignore_eos=True) for p in prompts]
    streams = [iter(h) for h in handles]
    assert all(next(it).token_ids for it in streams)
    engine.clear_prefix_cache()
    return handles, streams


@pytest.fixture(scope="module")
def words(engine):
    def make(n: int, seed: int = 0) -> list[int]:
        text = " ".join(f"w{(i * 7 + seed * 13) % 101} is item {i + seed}." for i in range(n))
        ids = engine.encode(text)
        assert len(ids) >= n
        return ids[:n]

    return make


@pytest.fixture
def fresh(tiny_model_dir):
    """A fresh engine per test (its counters start at zero): ``fresh(**config)``; the tiny model unless
    ``model`` is given (None: the default model)."""
    made = []

    def make(model=str(tiny_model_dir), **config):
        made.append(Engine(model, speculative=None, **config))
        return made[-1]

    yield make
    for eng in made:
        eng.shutdown()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_prompt_that_misses_the_cache_is_written_once(fresh, words, kv_bits):
    # quantized KV: the default model (the tiny one's 16-wide heads are too narrow for its groups)
    eng = fresh(None, kv_bits=8) if kv_bits else fresh()
    prompt = words(200)
    written, prefilled, decoded = _run(eng, [prompt])
    assert prefilled == len(prompt) - 1  # all but the last token (it runs in the first decode step)
    _once(eng, written, prefilled, decoded)


def test_a_prompt_that_hits_the_cache_writes_only_its_new_tokens(fresh, words):
    eng = fresh()
    doc = words(200)
    _run(eng, [doc])
    tail = words(30, seed=5)
    written, prefilled, decoded = _run(eng, [doc + tail])
    assert prefilled <= len(tail) + 8  # the document is read from the tree's pages, not recomputed
    _once(eng, written, prefilled, decoded)


def test_a_fan_out_over_a_cached_prefix_writes_each_row_once(fresh, words):
    eng = fresh()
    prefix = words(160)
    _run(eng, [prefix + words(6, seed=1)])  # the prefix is in the tree
    questions = [words(5 + i, seed=10 + i) for i in range(6)]
    written, prefilled, decoded = _run(eng, [prefix + q for q in questions], max_tokens=4)
    assert prefilled <= sum(len(q) + 8 for q in questions)
    _once(eng, written, prefilled, decoded)


def test_a_batch_of_uneven_prompts_and_a_chunked_prompt_write_only_real_positions(fresh, words):
    """Prompts of different lengths prefill in one padded group; a prompt longer than a chunk prefills
    chunk by chunk into the same row: no padding position and no chunk is stored twice."""
    eng = fresh(prefill_chunk=64)
    uneven = [words(n, seed=n) for n in (9, 23, 40, 17)]
    _once(eng, *_run(eng, uneven))
    _once(eng, *_run(eng, [words(300, seed=3)]))


def test_long_prompts_chunk_side_by_side_on_the_lanes_streams(fresh, words):
    """Where prefill forwards run one per lane's stream (a multi-lane CPU without the native kernels: each
    on its own core), long contexts are chunked one per stream in the same step: both cores prefill. Each
    KV token is still written once, the answers equal each prompt alone, and a prompt whose uncached
    prefix another chunked prompt is computing waits for the radix tree instead (computed once)."""
    eng = fresh(backend="cpu-mlx", decode_lanes=2, prefill_chunk=64, prefill_budget=128)
    runner = eng._scheduler.runner
    assert runner.prefill_streams == 2
    items = []
    prefill = runner.prefill

    def record(work):
        items.append((work.kind, len(work.seqs), list(work.new)))
        return prefill(work)

    runner.prefill = record
    prompts = [words(200, seed=s) for s in (1, 2, 3)]
    alone = []
    for p in prompts:
        eng.clear_prefix_cache()
        alone.append(eng.generate([p], max_tokens=4, temperature=0, ignore_eos=True)[0].token_ids)
    eng.clear_prefix_cache()
    items.clear()
    written, prefilled, decoded = _run(eng, prompts, max_tokens=4)
    _once(eng, written, prefilled, decoded)
    assert sum(len(p) - 1 for p in prompts) - 16 <= prefilled <= sum(len(p) - 1 for p in prompts)
    side_by_side = [new for kind, n, new in items if kind == "chunk" and n == 2]
    assert side_by_side and all(sum(new) <= 128 for new in side_by_side), items
    together = eng.generate(prompts, max_tokens=4, temperature=0, ignore_eos=True)
    eng.clear_prefix_cache()
    assert [c.token_ids for c in eng.generate(prompts, max_tokens=4, temperature=0, ignore_eos=True)] == alone
    assert [c.token_ids for c in together] == alone  # the second run hit the cache: equal too

    # Two prompts over one long uncached prefix: the second does not recompute it beside the first.
    eng.clear_prefix_cache()
    doc = words(240, seed=7)
    written, prefilled, decoded = _run(eng, [doc + words(6, seed=8), doc + words(7, seed=9)])
    assert prefilled <= len(doc) + 6 + 7 + 16
    _once(eng, written, prefilled, decoded)


@pytest.mark.parametrize("lanes, kv_bits", [(1, None), (2, None), (1, 8)])
def test_a_chunk_computed_in_the_decode_forward_is_written_once_and_equals_alone(fresh, words, lanes, kv_bits):
    """A long prompt's chunks that spend the step's prefill budget while rows decode run in the decode
    forward (``kv/fused_step.py``): the same tokens as each prompt alone and as unfused steps, each KV token
    written once (8-bit KV too: the default model). With two lanes and the chunk's row in the lane that
    decodes nothing, its forward runs beside the other lane's."""
    config = dict(prefill_chunk=64, prefill_budget=64, decode_lanes=lanes)
    eng = fresh(None, kv_bits=8, **config) if kv_bits else fresh(**config)
    if lanes == 2:
        eng._scheduler.batch.fill_rows = 3  # the three short rows fill lane 0: the long prompt's row opens in lane 1
    short = [words(12, seed=s) for s in (1, 2, 3)]
    long = words(300, seed=4)
    alone = []
    for p in short + [long]:
        eng.clear_prefix_cache()
        alone.append(eng.generate([p], max_tokens=24, temperature=0, ignore_eos=True)[0].token_ids)

    def together():
        eng.clear_prefix_cache()
        handles = [eng.submit(p, max_tokens=24, temperature=0, ignore_eos=True) for p in short]
        streams = [iter(h) for h in handles]
        assert all(next(it).token_ids for it in streams)  # every short row decodes before the long prompt arrives
        eng.clear_prefix_cache()  # no hit for the long prompt (one held in lane 0's pool would be copied)
        w0, p0, d0 = _counts(eng)
        late = eng.submit(long, max_tokens=24, temperature=0, ignore_eos=True)
        for it in streams:
            for _ in it:
                pass
        results = [h.request.result.token_ids for h in handles] + [eng._collect(late).token_ids]
        w1, p1, d1 = _counts(eng)
        return results, (w1 - w0, p1 - p0, d1 - d0)

    fused0 = eng.stats()["fused_prefill_tokens"]
    results, counts = together()
    assert eng.stats()["fused_prefill_tokens"] - fused0 >= 128  # at least two of the long prompt's chunks
    assert results == alone
    _once(eng, *counts)
    eng.config.fuse_prefill = False
    fused0 = eng.stats()["fused_prefill_tokens"]
    assert together()[0] == alone
    assert eng.stats()["fused_prefill_tokens"] == fused0


@pytest.mark.parametrize("lanes", [1, 2])
def test_prompts_that_join_the_decode_forward_that_prefills_them(fresh, words, lanes):
    """Short prompts of different lengths arriving while rows decode are the step's prefill: one
    padded group in the decode forward (``kv/fused_step.py``), and they join that forward's decode rows
    (their last context token is one of its positions, reading in each layer what their other tokens wrote
    just before). Equal to each prompt alone, each KV token written once, no forward of their own (where
    the runner has one prefill stream)."""
    eng = fresh(prefill_chunk=256, prefill_budget=256, decode_lanes=lanes)
    running = [words(12, seed=s) for s in (1, 2)]
    arriving = [words(n, seed=n) for n in (9, 23, 40)]
    alone = _alone(eng, running + arriving, 16)
    handles, streams = _decoding(eng, running, 16)
    before = eng.stats()
    w0, p0, d0 = _counts(eng)
    late = [eng.submit(p, max_tokens=16, temperature=0, ignore_eos=True) for p in arriving]
    for it in streams:
        for _ in it:
            pass
    results = [h.request.result.token_ids for h in handles] + [eng._collect(h).token_ids for h in late]
    w1, p1, d1 = _counts(eng)
    after = eng.stats()
    assert results == alone
    _once(eng, w1 - w0, p1 - p0, d1 - d0)
    if eng._scheduler.runner.prefill_streams == 1:
        assert after["fused_prefill_tokens"] - before["fused_prefill_tokens"] == sum(len(p) - 1 for p in arriving)
        assert after["prefill_forwards"] == before["prefill_forwards"]
    # else (two lanes' streams, each on one core: the pure-MLX path on this CPU) a group of several prompts
    # is split over both cores' streams instead, and only a group of one runs in the decode forward


def test_several_prefill_items_in_one_decode_forward(fresh, tmp_path, monkeypatch):
    """A long prompt's last chunk and two groups of short prompts, planned in one step beside decoding rows,
    are all computed by that step's decode forward (``kv/fused_step.py``): no prefill forward, each KV token
    written once, each answer equal to its prompt alone. A prompt that continues the uncached prefix of
    another prompt of the step waits for the next step and reads that prefix from the tree (computed once)."""
    import json

    from .model_zoo import prompt_ids

    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PARALLM_STEP_TRACE", str(trace))
    # A fixed budget (no step-time target) and one prefill stream: the same plan on every backend.
    eng = fresh(prefill_chunk=64, prefill_budget=512, decode_lanes=1)
    eng.run_on_engine_thread(lambda: setattr(eng._scheduler.config, "step_time_target_s", 0.0))
    vocab = eng.model_info.vocab_size
    running = [prompt_ids(12, vocab, seed=s) for s in (1, 2)]
    arriving = [prompt_ids(101, vocab, seed=3)] + [prompt_ids(n, vocab, seed=n) for n in (10, 24, 41)]
    shared = prompt_ids(40, vocab, seed=9)
    twins = [shared + prompt_ids(5, vocab, seed=10), shared + prompt_ids(6, vocab, seed=11)]
    alone = _alone(eng, arriving + twins, 8)
    _, streams = _decoding(eng, running, 400)  # rows that decode all along (prompts fuse only beside them)
    before = eng.stats()
    w0, p0, d0 = _counts(eng)
    lines0 = len(trace.read_text().splitlines())
    # Submitted between two steps (on the engine thread): the plan does not depend on arrival timing.
    late = eng.run_on_engine_thread(lambda: [eng.submit(p, max_tokens=8, temperature=0, ignore_eos=True)
                                             for p in arriving + twins])
    for it in streams:
        for _ in it:
            pass
    results = [eng._collect(h).token_ids for h in late]
    w1, p1, d1 = _counts(eng)
    after = eng.stats()
    assert results == alone
    _once(eng, w1 - w0, p1 - p0, d1 - d0)
    # The long prompt: chunks of 64 and 36; the shorts: groups (9 + 23) and (40); the first twin (44), all
    # fused; the second twin continues the first's 40 uncached tokens: it waits one step, reads them from the
    # tree and computes only its own 5, fused too.
    assert after["prefill_forwards"] - before["prefill_forwards"] == 0
    assert after["fused_prefill_chunks"] - before["fused_prefill_chunks"] == 6
    assert after["fused_prefill_tokens"] - before["fused_prefill_tokens"] == 100 + 9 + 23 + 40 + 44 + 5
    assert late[-1].request.result.usage.cached_tokens == 40
    steps = [json.loads(line) for line in trace.read_text().splitlines()[lines0:]]
    assert max(s["fused_tokens"] for s in steps) == 36 + 9 + 23 + 40 + 44  # several items in one forward
