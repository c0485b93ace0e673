"""A prefix that several decode rows continue is held once (kv_cache.SharedPrefix, read by
cpu_kernels.cascade_attention): the tokens do not change, the batch holds fewer bytes, and the prefix
is released (its radix node unpinned) when the last row that uses it leaves, however it leaves."""

from __future__ import annotations

import time

import pytest

from parallm_engine import Engine
from parallm_engine.kv.prefix_sharing import MIN_SHARED_PREFIX


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """The same tiny model twice: holding shared prefixes once, and with one copy per row."""
    shared = Engine(str(tiny_model_dir), decode_lanes=2)
    copies = Engine(str(tiny_model_dir), decode_lanes=2)
    copies._scheduler._share_prefix = False
    for e in (shared, copies):
        e._scheduler.batch.fill_rows = 1  # a few rows over both lanes
    assert shared._scheduler._share_prefix, "the tiny llama runs through the engine's attention hook"
    yield shared, copies
    shared.shutdown()
    copies.shutdown()


def _prefix(engine, repeat: int = 5) -> list[int]:
    ids = engine.encode("You are an agent. Tools: search(query), fetch(url), sum(a, b). Rules: be brief. " * repeat)
    assert len(ids) >= MIN_SHARED_PREFIX + 8
    return ids


def _joins(engine) -> list[tuple[list[bool] | None, int, int, list]]:
    """Record every join's shared-prefix flags, the prefix length the batch holds then, how many rows
    read it then (those that joined continuing it and those that adopted it), and the joining prompts."""
    sched = engine._scheduler
    seen = []
    original = sched.batch.join

    def join(seqs, shared=None):
        original(seqs, shared)
        batch = sched.batch
        seen.append((list(shared) if shared else None, batch.shared.length if batch.shared else 0,
                     sum(sum(lane.kv.shared_rows) for lane in batch.lanes), [s.prompt_ids for s in seqs]))

    sched.batch.join = join
    return seen


def _wait_idle(engine, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while engine.running_count and time.monotonic() < end:
        time.sleep(0.01)
    engine.run_on_engine_thread(lambda: None)


def _released(engine) -> bool:
    sched = engine._scheduler
    return engine.run_on_engine_thread(
        lambda: sched.batch.shared is None and all(n.ref == 0 for n in sched.radix._iter_nodes()))


def _tokens(engine, prompts, lengths):
    handles = [engine.submit(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(prompts, lengths)]
    return [engine._collect(h).token_ids for h in handles]


def test_fanout_holds_the_prefix_once_and_gives_the_same_tokens(engines):
    shared, copies = engines
    prefix = _prefix(shared)
    prompts = [prefix + shared.encode(f" Task {i}: " + "step " * i, add_special_tokens=False) for i in range(6)]
    lengths = [5 + 4 * i for i in range(6)]  # rows leave at different steps
    joins = _joins(shared)
    got = _tokens(shared, prompts, lengths)
    assert got == _tokens(copies, prompts, lengths)
    assert got == [_tokens(copies, [p], [n])[0] for p, n in zip(prompts, lengths)]
    # Every request ended up continuing the one prefix, the first one (which computed it) included.
    assert max(rows for _, _, rows, _ in joins) == len(prompts)
    assert max(length for _, length, _, _ in joins) >= len(prefix) - 1
    _wait_idle(shared)
    assert _released(shared)


def test_shared_batch_holds_fewer_bytes(engines):
    shared, copies = engines
    prefix = _prefix(shared, 15)  # longer than one 256-column step of row storage
    assert 256 < len(prefix) < 400
    prompts = [prefix + shared.encode(f" Item {i}.", add_special_tokens=False) for i in range(6)]
    peaks = []
    for engine in (shared, copies):
        engine.generate([prompts[0]], max_tokens=1, temperature=0)  # the prefix is in the tree
        handles = [engine.submit(p, max_tokens=40, temperature=0, ignore_eos=True) for p in prompts]
        stream = iter(handles[0])  # (one iterator: closing one aborts its request)
        for _ in range(5):
            next(stream)
        peaks.append(engine.stats()["kv_bytes"])
        for h in handles:
            engine._collect(h)
    assert 0 < peaks[0] < peaks[1]


def test_later_requests_join_the_held_prefix_or_not(engines):
    """While the batch holds a prefix, a request continuing it joins as a sharing row and one that does
    not joins with its whole KV; everybody's tokens equal their runs alone."""
    shared, copies = engines
    prefix = _prefix(shared)
    first = [prefix + shared.encode(f" Question {i}?", add_special_tokens=False) for i in range(3)]
    # The batch holds the longest prefix the first group shares (through " Question"): a later request
    # continuing all of it shares it too.
    later_same = prefix + shared.encode(" Question 99, a late one?", add_special_tokens=False)
    later_other = shared.encode("Something unrelated entirely, with no shared system prompt at all.")
    joins = _joins(shared)
    handles = [shared.submit(p, max_tokens=60, temperature=0, ignore_eos=True) for p in first]
    stream = iter(handles[0])
    for _ in range(3):
        next(stream)
    late = [shared.submit(p, max_tokens=12, temperature=0, ignore_eos=True) for p in (later_same, later_other)]
    late_tokens = [shared._collect(h).token_ids for h in late]
    first_tokens = [shared._collect(h).token_ids for h in handles]
    late = (later_same, later_other)
    late_flags = [f for fl, length, _, ps in joins if length
                  for f, p in zip(fl or [False] * len(ps), ps) if p in late]
    assert sorted(late_flags) == [False, True]
    assert late_tokens == [_tokens(copies, [p], [12])[0] for p in (later_same, later_other)]
    assert first_tokens == [_tokens(copies, [p], [60])[0] for p in first]
    _wait_idle(shared)
    assert _released(shared)


def test_cancelled_sharing_rows_release_the_prefix(engines):
    shared, _ = engines
    prefix = _prefix(shared)
    prompts = [prefix + shared.encode(f" Job {i}.", add_special_tokens=False) for i in range(4)]
    handles = [shared.submit(p, max_tokens=200, temperature=0, ignore_eos=True) for p in prompts]
    stream = iter(handles[0])
    for _ in range(3):
        next(stream)
    assert shared.run_on_engine_thread(lambda: shared._scheduler.batch.shared is not None)
    for h in handles:
        h.abort()
    _wait_idle(shared)
    assert shared.stats()["kv_bytes"] == 0
    assert _released(shared)


def test_fan_out_on_the_pure_mlx_path_holds_the_prefix_once(engines, tiny_model_dir):
    """The path Metal and CUDA take (MLX ops only, no engine CPU kernels): 32 rows continuing one
    cached 320-token prefix (the tiny model's context is 512) hold it once (the MLX-op cascade) and give
    the native path's greedy tokens."""
    from parallm_engine import Engine

    shared, _ = engines
    prefix = shared.encode("You are an agent with tools: search, fetch, sum. Answer briefly and cite sources. " * 24)
    P = 320
    prefix = prefix[:P]
    prompts = [prefix + shared.encode(f" Question {i}: what is {i} plus {i}?") for i in range(32)]
    mlx_only = Engine(str(tiny_model_dir), backend="cpu-mlx", decode_lanes=1)
    try:
        assert mlx_only.backend.name == "cpu-mlx" and not mlx_only.backend.cpu_kernels
        assert mlx_only._scheduler._share_prefix and not mlx_only._scheduler.native_kernels
        for eng in (shared, mlx_only):
            eng.generate([prefix + [5]], max_tokens=1, temperature=0)  # the prefix is in the tree
            eng.reset_peaks()
        want = [r.token_ids for r in shared.generate(prompts, max_tokens=16, temperature=0)]
        joins = _joins(mlx_only)
        got = mlx_only.generate(prompts, max_tokens=16, temperature=0)
        # every row read the one copy of the prefix (joining with it, or the first adopting it)
        assert max(rows for _, length, rows, _ in joins if length >= P) == 32
        assert [r.token_ids for r in got] == want
        assert all(r.usage.cached_tokens >= P for r in got)
        per_token = mlx_only.model_info.kv_bytes_per_token()
        # Held once: the prefix plus each row's own tokens (left-padded, allocated in steps of 256).
        assert mlx_only.stats()["peak_kv_bytes"] <= 1.2 * (P + 32 * 256) * per_token
        assert mlx_only.stats()["peak_kv_bytes"] < 32 * P * per_token
    finally:
        mlx_only.shutdown()


def test_fan_out_whose_questions_branch_off_each_other_reads_one_cached_prefix(tiny_model_dir):
    """Questions over one cached document whose cached match ends a few tokens into another question
    (" Question 1" vs " Question 12"): every prefill of the group reads one copy of the document (no
    private copy per prompt) and every answer equals the same request on a cold engine."""
    from parallm_engine import Engine
    from parallm_engine.kv.paged_kv import SHORT_TAIL_TOKENS

    eng = Engine(str(tiny_model_dir))
    cold = Engine(str(tiny_model_dir), enable_prefix_cache=False)
    try:
        doc = eng.encode(" ".join(f"Fact {i}: item{i} costs {i * 3 % 97} coins." for i in range(40)))[:300]
        qs = [eng.encode(f" Question {i}: what does item{i * 7} cost?", add_special_tokens=False)
              for i in (12, 2, 13, 14, 15, 16)]
        for q in qs[:2]:  # the tree: the document + " Question", then "12: ..." and "2: ..."
            eng.generate([doc + q], max_tokens=1, temperature=0)
        qs = qs[1:]  # " Question 13" etc. reach one token ("1") into " Question 12"'s node
        sched = eng._scheduler
        seen = []
        start = sched._start_prefill

        def record(seq):
            start(seq)
            seen.append((seq.cached_tokens, [len(n.tokens) for n in seq.match.nodes()]))

        sched._start_prefill = record
        meter, stats = sched.kv.meter, eng.stats
        written, prefilled = meter.written, stats()["prefill_tokens"]
        results = eng.generate([doc + q for q in qs[1:]], max_tokens=6, temperature=0, ignore_eos=True)
        # " Question 12" reaches 1-2 tokens into " Question 1...": stopped at the node before.
        assert seen and all(nodes[-1] >= SHORT_TAIL_TOKENS for _, nodes in seen), seen
        assert all(cached >= len(doc) for cached, _ in seen), seen
        # No copy of the document for any prompt of the group (its pages are read where they are, or as
        # the batch's one shared prefix): the KV written is the computed tokens' and the decode steps'.
        bpt = sched.kv.kv_bytes_per_token
        computed = stats()["prefill_tokens"] - prefilled
        assert computed < len(qs) * 40
        assert meter.written - written <= bpt * (computed + len(results) * 8)
        for q, r in zip(qs[1:], results):
            assert r.token_ids == cold.generate([doc + q], max_tokens=6, temperature=0, ignore_eos=True)[0].token_ids
    finally:
        eng.shutdown()
        cold.shutdown()
