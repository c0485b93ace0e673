"""Memory: admission by what is held (not by max_tokens), preemption instead of failure, bounded
sliding-window KV, and prefix reuse for hybrid (recurrent) models."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)

from .model_zoo import build, default_tokenizer, prompt_ids, reference_greedy


def _wait(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_preemption_completes_everything_with_the_tokens_of_a_solo_run(tiny_engine, tiny_model_dir):
    """A budget far too small for 64 concurrent requests: all complete, greedy and seeded outputs equal
    each request run alone, and the scheduler preempted (freed and later resumed) running sequences."""
    from parallm_engine import Engine

    vocab = tiny_engine.model_info.vocab_size
    prompts = [prompt_ids(8 + (i % 13), vocab, seed=i) for i in range(64)]
    kwargs = [dict(temperature=0) if i % 4 else dict(temperature=0.8, seed=100 + i) for i in range(64)]
    alone = [tiny_engine.generate([p], max_tokens=24, ignore_eos=True, **kw)[0].token_ids
             for p, kw in zip(prompts, kwargs)]
    per_token = tiny_engine.model_info.kv_bytes_per_token()
    small = Engine(str(tiny_model_dir), kv_budget_bytes=per_token * 400, decode_lanes=1)
    try:
        handles = [small.submit(p, max_tokens=24, ignore_eos=True, **kw) for p, kw in zip(prompts, kwargs)]
        results = [small._collect(h) for h in handles]
        assert [r.token_ids for r in results] == alone
        stats = small.stats()
        assert stats["preemptions"] > 0
        assert stats["requests_finished"] == 64 and stats["requests_aborted"] == 0
        assert _wait(lambda: small.stats()["kv_bytes"] == 0)
    finally:
        small.shutdown()


@pytest.fixture(scope="module")
def eight_b_shaped(tmp_path_factory):
    """Llama-3.1-8B's attention shape (8 KV heads x 128, 131072 positions), cut to 2 layers and a small
    hidden size: 16 KiB of KV per token, as an 8B model has per 2 layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    tok_dir, vocab = default_tokenizer()
    out = tmp_path_factory.mktemp("llama-8b-shape")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / name).exists():
            (out / name).write_bytes((tok_dir / name).read_bytes())
    config = {
        "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 2, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "vocab_size": vocab, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_large_max_tokens_do_not_serialise_an_8b_shaped_model(eight_b_shaped):
    """32 streams with max_tokens=32768 decode together (admission counts what is held, not the
    budget), and one request asking for a billion tokens does not hold back a 2-token request."""
    from parallm_engine import Engine

    eng = Engine(str(eight_b_shaped), kv_budget_bytes=4 << 30, decode_lanes=1)
    try:
        assert eng.model_info.kv_bytes_per_token() == 2 * 2 * 8 * 128 * 4
        handles = [eng.submit(prompt_ids(20, eng.model_info.vocab_size, seed=i), max_tokens=32768,
                              temperature=0, ignore_eos=True) for i in range(32)]
        assert _wait(lambda: eng.stats()["peak_running"] >= 32, timeout=180)
        for h in handles:
            h.abort()
        assert _wait(lambda: eng.running_count == 0)
        huge = eng.submit("Once upon a time", max_tokens=10**9, temperature=0, ignore_eos=True)
        assert _wait(lambda: eng.stats()["running"] >= 1)
        t0 = time.monotonic()
        small = eng.generate(["Hi"], max_tokens=2, temperature=0, ignore_eos=True)[0]
        assert len(small.token_ids) == 2 and not huge.request.finished
        assert time.monotonic() - t0 < 60
        huge.abort()
    finally:
        eng.shutdown()


def test_sliding_window_long_prompt_matches_mlx_lm_with_bounded_kv(tmp_path):
    """A 1,000-token prompt on a window-64 model gives mlx-lm's tokens, and the sliding layers hold at
    most the window while it decodes."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache
    from mlx_lm.utils import load

    from parallm_engine import Engine

    tok_dir, vocab = default_tokenizer()
    path = build("gemma3_text", tmp_path / "g3", tok_dir, vocab, overrides={"sliding_window": 64})
    ref, _ = load(str(path))
    ref.set_dtype(mx.float32)
    prompt = prompt_ids(1000, vocab, seed=3)
    want = reference_greedy(ref, prompt, 16)
    eng = Engine(str(path), decode_lanes=1)
    try:
        handle = eng.submit(prompt, max_tokens=16, temperature=0, ignore_eos=True)
        seen = []

        def window_layers():
            caches = eng._scheduler.batch.caches or []
            return [c.keys.shape[2] for c in caches if isinstance(c, BatchRotatingKVCache) and c.keys is not None]

        tokens = []
        for delta in handle:
            tokens += delta.token_ids
            seen += eng.run_on_engine_thread(window_layers)
        assert tokens == want
        assert seen and max(seen) <= 64
        per_layer_token = 2 * 2 * 16 * 4  # (K + V) x 2 KV heads x head_dim 16 x fp32
        full = 2 * (1016 + 256) * per_layer_token  # the 2 global layers, allocated in steps of 256
        sliding = 2 * 64 * per_layer_token  # the 2 window layers: the window, whatever the context
        assert eng.stats()["peak_kv_bytes"] <= full + sliding
        assert eng.stats()["peak_kv_bytes"] < 0.7 * 4 * 1016 * per_layer_token  # vs every layer full
    finally:
        eng.shutdown()


def test_hybrid_model_reuses_a_shared_prefix(tmp_path):
    """A recurrent hybrid (qwen3_next: gated delta + attention): 16 requests sharing a 300-token
    prefix; a second wave hits the prefix snapshots and gives the cold run's tokens."""
    from parallm_engine import Engine

    tok_dir, vocab = default_tokenizer()
    path = build("qwen3_next", tmp_path / "q3n", tok_dir, vocab)
    shared = prompt_ids(300, vocab, seed=11)
    first = [shared + prompt_ids(12, vocab, seed=100 + i) for i in range(16)]
    second = [shared + prompt_ids(15, vocab, seed=200 + i) for i in range(16)]
    cold = Engine(str(path), decode_lanes=1, enable_prefix_cache=False)
    try:
        want = [r.token_ids for r in cold.generate(second, max_tokens=8, temperature=0, ignore_eos=True)]
    finally:
        cold.shutdown()
    eng = Engine(str(path), decode_lanes=1)
    try:
        eng.generate(first, max_tokens=8, temperature=0, ignore_eos=True)
        wave2 = eng.generate(second, max_tokens=8, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in wave2] == want
        assert all(r.usage.cached_tokens >= 300 for r in wave2)
        assert eng.stats()["prefix_cache"]["kind"] == "snapshots"
    finally:
        eng.shutdown()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "pin", "unpin", "evict"]),
                          st.integers(0, 5), st.integers(1, 6)), max_size=40),
       st.integers(0, 3000))
def test_snapshot_cache_accounting_under_any_operation_sequence(ops, budget):
    """The snapshot store (recurrent / window models): bytes counted equal the snapshots' arrays after
    any sequence of inserts, matches, pins and evictions; pinned snapshots are never evicted; a match
    is always a stored prefix of the query; restored caches are independent of the stored ones."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    from parallm_engine.kv.snapshot_cache import SnapshotCache

    def state(n):
        kv, arr = KVCache(), ArraysCache(1)
        kv.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
        arr[0] = mx.full((1, 3), float(n))
        return [kv, arr]

    cache = SnapshotCache(budget)
    pinned = []
    for op, a, n in ops:
        tokens = [a] * n
        if op == "insert":
            cache.insert(tokens, state(n))
        elif op == "match":
            hit = cache.match(tokens + [9])
            assert hit is None or list(hit.tokens) == (tokens + [9])[: len(hit.tokens)]
            if hit is not None:
                restored = cache.restore(hit)
                restored[1][0] = mx.zeros((1, 3))  # writing a restored copy leaves the snapshot alone
                assert hit.caches[1][0].sum().item() == 3.0 * len(hit.tokens)
        elif op == "pin":
            hit = cache.match(tokens, record=False)
            if hit is not None:
                cache.pin(hit)
                pinned.append(hit)
        elif op == "unpin" and pinned:
            cache.unpin(pinned.pop())
        else:
            cache.evict(a * 100)
        assert cache.total_bytes == cache.computed_bytes()
        held = {s.tokens for d in cache._by_len.values() for s in d.values()}
        assert all(p.tokens in held for p in pinned)
        unpinned_bytes = sum(s.nbytes for d in cache._by_len.values() for s in d.values() if s.ref == 0)
        assert cache.total_bytes <= budget or unpinned_bytes == 0 or op != "insert"


def test_admission_takes_turns_across_groups(tiny_model_dir):
    """One caller's 40 prompts (one group) queued first do not lock out another caller's 2: with 4
    slots, the 2 are admitted as soon as slots free, before most of the 40 (first-come-first-served
    would finish all 40 first)."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), max_batch_size=4, decode_lanes=1)
    try:
        vocab = eng.model_info.vocab_size
        args = dict(max_tokens=8, temperature=0, ignore_eos=True)
        big = [eng.submit(prompt_ids(10, vocab, seed=i), group="big", **args) for i in range(40)]
        small = [eng.submit(prompt_ids(10, vocab, seed=100 + i), group="small", **args) for i in range(2)]
        results = [eng._collect(h) for h in big + small]
        assert all(len(r.token_ids) == 8 for r in results)
        small_done = max(h.request.finish_time for h in small)
        assert sum(h.request.finish_time > small_done for h in big) >= 30
    finally:
        eng.shutdown()


def test_prefill_is_cut_to_the_step_time_target(tiny_model_dir):
    """Prefill tokens per step follow the measured rate and the step-time target (so aborts, arrivals
    and running streams wait about one target at most), never below the minimum progress; a short
    prompt is not cut (it goes first, whole)."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_budget=2048)
    try:
        sched = eng._scheduler

        def budget(rate, other):
            sched._prefill_rate, sched._other_step_s = rate, other
            return sched.prefill_token_budget()

        assert eng.run_on_engine_thread(lambda: budget(1000.0, 0.05)) == 200
        assert eng.run_on_engine_thread(lambda: budget(100.0, 0.5)) == sched.config.min_prefill_tokens
        # A decode step longer than the target (a large batch): prefill gets as long as the decode.
        assert eng.run_on_engine_thread(lambda: budget(1000.0, 0.4)) == 400
        assert eng.run_on_engine_thread(lambda: budget(1e6, 0.0)) == 2048
        # With nothing decoding, a step prefills a whole chunk: no stream's inter-token latency is at stake.
        vocab = eng.model_info.vocab_size
        eng.run_on_engine_thread(lambda: budget(1000.0, 0.05))
        forwards = eng.stats()["prefill_forwards"]
        eng.generate([prompt_ids(450, vocab, seed=5)], max_tokens=2, temperature=0)
        assert eng.stats()["prefill_forwards"] - forwards == 1
        # Next to a decoding stream, at a slow measured rate (held there: no step re-measures it), a prompt
        # longer than a chunk is prefilled over many steps at the paced budget, decode moving in between,
        # its last chunk included (it attends over the whole context); a short prompt (its whole prefill
        # one chunk) goes in one forward, as does a long prompt's uncached rest once the prefix cache
        # holds the rest.
        running = eng.submit(prompt_ids(8, vocab, seed=6), max_tokens=400, temperature=0, ignore_eos=True)
        assert _wait(lambda: eng.stats()["running"] == 1)

        def slow():
            sched.config.prefill_chunk = 128
            sched._observe_prefill = lambda rate: None
            sched._prefill_rate, sched._other_step_s = 100.0, 0.05

        eng.run_on_engine_thread(slow)
        paced = eng.run_on_engine_thread(sched.prefill_token_budget)
        assert paced == sched.config.min_prefill_tokens == 64
        chunks = lambda: eng.stats()["prefill_forwards"] + eng.stats()["fused_prefill_chunks"]  # noqa: E731
        for n, want in ((100, 1), (120, 1), (450, -(-449 // paced))):
            forwards = chunks()  # a chunk computed in the decode forward (kv/fused_step.py) counts as one
            eng.generate([prompt_ids(n, vocab, seed=7 + n)], max_tokens=2, temperature=0)
            assert chunks() - forwards == want, (n, chunks() - forwards)
        long_prompt = prompt_ids(450, vocab, seed=7 + 450)
        forwards = chunks()
        eng.generate([long_prompt[:400] + prompt_ids(50, vocab, seed=99)], max_tokens=2, temperature=0)
        assert chunks() - forwards == 1
        running.abort()
    finally:
        eng.shutdown()


def test_an_embedding_burst_beside_decoding_rows_is_paced_and_chat_goes_first(tiny_model_dir):
    """Embedding texts (bulk work: a corpus being indexed) beside decoding rows get what they earn, a share
    of the rest of the step at the measured rate, not a whole chunk a step (a burst of them took the streams'
    step from milliseconds to the step-time target): a token bucket, a text run whole once its credit holds
    it (one forward of its own, not a small chunk every step, each a forward's cost); a chat prompt that
    arrives behind them is prefilled first."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=512)
    try:
        sched = eng._scheduler
        vocab = eng.model_info.vocab_size
        running = eng.submit(prompt_ids(8, vocab, seed=6), max_tokens=2000, temperature=0, ignore_eos=True)
        assert _wait(lambda: eng.stats()["running"] == 1)

        def slow():  # held: no step re-measures the rate; 200 tokens/s earns the 16-token minimum a step
            sched._observe_prefill = lambda rate: None
            sched._prefill_rate, sched._other_step_s = 200.0, 0.05

        eng.run_on_engine_thread(slow)
        forwards, steps = eng.stats()["prefill_forwards"], eng.stats()["steps"]
        texts = [prompt_ids(40, vocab, seed=100 + i) for i in range(12)]  # 480 tokens: 30 paced steps
        handles = [eng.submit_embedding(t, pooling="mean") for t in texts]
        chat = eng.submit(prompt_ids(12, vocab, seed=7), max_tokens=2, temperature=0)
        vectors = [h.result().embedding for h in handles]
        assert eng._collect(chat).token_ids
        # a whole chunk a step would be one step; paced, 16 tokens earned a step: at least 30 steps; a group
        # holds at most four steps' earning (64 tokens: one text), each whole in a forward of its own
        assert eng.stats()["steps"] - steps >= 480 // 16
        assert eng.stats()["prefill_forwards"] - forwards <= len(texts) + 1  # (+ the chat prompt's)
        first_token = chat.request.first_token_time
        assert first_token < max(h.request.finish_time for h in handles)  # not behind the whole burst
        running.abort()
        assert _wait(lambda: eng.stats()["running"] == 0)
        whole = eng.embed(texts, pooling="mean")  # idle: the texts in one forward
        np.testing.assert_allclose(vectors, whole, rtol=0, atol=2e-5)  # one at a time: the same vectors
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_embedding_texts_advance_beside_a_long_prompt_that_takes_every_step(tiny_model_dir, backend):
    """Chat prompts go before embedding texts, but the texts spend what they earn whatever the prompts take of
    a step's budget: behind a long prompt prefilled in chunks over many steps (each step's whole budget) they
    do not wait for all of it; the prompt's tokens are as alone."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=64, backend=backend)
    try:
        sched = eng._scheduler
        vocab = eng.model_info.vocab_size
        opts = dict(max_tokens=4, temperature=0)
        long_ids = prompt_ids(450, vocab, seed=8)
        running = eng.submit(prompt_ids(8, vocab, seed=6), max_tokens=2000, temperature=0, ignore_eos=True)
        assert _wait(lambda: eng.stats()["running"] == 1)

        def slow():  # held: 200 tokens/s, a step's paced budget is the 64-token minimum, the texts earn 16
            sched._observe_prefill = lambda rate: None
            sched._prefill_rate = 200.0

        eng.run_on_engine_thread(slow)
        long = eng.submit(long_ids, **opts)  # about 7 steps of 64 tokens
        texts = [eng.submit_embedding(prompt_ids(20, vocab, seed=300 + i), pooling="mean") for i in range(2)]
        vectors = [h.result().embedding for h in texts]
        tokens = eng._collect(long).token_ids
        assert max(h.request.finish_time for h in texts) < long.request.first_token_time
        running.abort()
        assert _wait(lambda: eng.stats()["running"] == 0)
        assert eng.generate([long_ids], **opts)[0].token_ids == tokens  # alone (a cache hit: the same tokens)
        whole = eng.embed([prompt_ids(20, vocab, seed=300 + i) for i in range(2)], pooling="mean")
        np.testing.assert_allclose(vectors, whole, rtol=0, atol=2e-5)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_embedding_texts_beside_decoding_rows_run_in_groups(tiny_model_dir, backend):
    """Where a step earns less than a text but a few steps earn several, the texts beside decoding rows wait
    for the credit of a group and run together (one forward for several texts): a bucket that ran each text
    as soon as it could afford it ran 64 texts in 64 forwards. The streams' tokens are unchanged."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=512, backend=backend)
    try:
        sched = eng._scheduler
        vocab = eng.model_info.vocab_size
        opts = dict(max_tokens=400, temperature=0, ignore_eos=True)
        alone = eng.generate([prompt_ids(8, vocab, seed=6)], **opts)[0].token_ids
        running = eng.submit(prompt_ids(8, vocab, seed=6), **opts)
        assert _wait(lambda: eng.stats()["running"] == 1)

        def held():  # 30 tokens earned a step (0.6 x 0.05 s x 1,000/s): a 40-token text takes two steps
            sched._observe_prefill = lambda rate: None
            sched._prefill_rate = 1000.0
            # this scheduler only: its steps' measured time is held at 50 ms
            held_step = property(lambda self: 0.05, lambda self, value: None)
            sched.__class__ = type("HeldScheduler", (type(sched),), {"_other_step_s": held_step})

        eng.run_on_engine_thread(held)
        forwards = eng.stats()["prefill_forwards"]
        texts = [prompt_ids(40, vocab, seed=200 + i) for i in range(12)]
        vectors = [h.result().embedding for h in [eng.submit_embedding(t, pooling="mean") for t in texts]]
        # four steps earn 120 tokens: groups of three texts
        assert eng.stats()["prefill_forwards"] - forwards <= len(texts) // 3
        assert eng._collect(running).token_ids == alone
        whole = eng.embed(texts, pooling="mean")
        np.testing.assert_allclose(vectors, whole, rtol=0, atol=2e-5)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_a_burst_on_an_idle_engine_is_prefilled_in_one_step(tiny_model_dir, backend, tmp_path, monkeypatch):
    """Short prompts that arrive together at an idle engine are all prefilled in the first step (several
    prefill forwards of at most a chunk each) and decode together from then on, as mlx-lm's BatchGenerator
    does; paced over steps, each later wave would pay the decode steps of the waves before it. Prompts
    arriving into a running batch are still paced (test_prefill_is_cut_to_the_step_time_target). Every
    answer is the one the prompt gets alone."""
    import threading

    from parallm_engine import Engine

    if backend:
        monkeypatch.setenv("PARALLM_BACKEND", backend)
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PARALLM_STEP_TRACE", str(trace))
    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=128, prefill_budget=2048)
    try:
        vocab = eng.model_info.vocab_size
        eng.generate([prompt_ids(20, vocab, seed=1)], max_tokens=2, temperature=0)  # warm-up: the rate is measured
        eng.clear_prefix_cache()
        seen = len(trace.read_text().splitlines())  # the trace is line-buffered
        prompts = [prompt_ids(60 + i, vocab, seed=40 + i) for i in range(10)]  # 645 tokens: 6 chunks of 128
        args = dict(max_tokens=4, temperature=0, ignore_eos=True)
        release, held = threading.Event(), threading.Event()
        # Hold the engine thread between steps until every prompt is queued: they arrive together.
        holder = threading.Thread(target=eng.run_on_engine_thread, args=(lambda: (held.set(), release.wait(30)),))
        holder.start()
        assert held.wait(30)
        handles = [eng.submit(p, **args) for p in prompts]
        release.set()
        holder.join()
        answers = [eng._collect(h).token_ids for h in handles]
        steps = [json.loads(line) for line in trace.read_text().splitlines()[seen:]]
        first = next(s for s in steps if s["joined"])
        assert first["joined"] == len(prompts), [s["joined"] for s in steps]
        assert first["prefill_tokens"] + first["fused_tokens"] == sum(len(p) - 1 for p in prompts)
        eng.clear_prefix_cache()
        assert [eng.generate([p], **args)[0].token_ids for p in prompts] == answers
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_short_prompts_go_ahead_of_a_paced_long_one_without_starving_it(tiny_model_dir, backend, monkeypatch):
    """A long prompt prefilled at the step-time target's pace over many steps does not hold up short
    prompts sent after it: they go ahead (shortest job first), a chunk of them a step, and get their
    answers before it. However many are queued, the long prompt still advances every step (at least by
    the minimum progress, here its paced share), and lets through at most its own length in their
    tokens, so it is answered long before the last of them. Every answer is the one each prompt
    gets alone."""
    from parallm_engine import Engine

    if backend:
        monkeypatch.setenv("PARALLM_BACKEND", backend)
    eng = Engine(str(tiny_model_dir), decode_lanes=1, prefill_budget=2048)
    try:
        sched = eng._scheduler
        vocab = eng.model_info.vocab_size
        running = eng.submit(prompt_ids(8, vocab, seed=6), max_tokens=400, temperature=0, ignore_eos=True)
        assert _wait(lambda: eng.stats()["running"] == 1)

        def slow():  # a slow measured rate, held: the long prompt is paced at the minimum progress
            sched.config.prefill_chunk = 128
            sched._observe_prefill = lambda rate: None
            sched._prefill_rate, sched._other_step_s = 100.0, 0.05

        eng.run_on_engine_thread(slow)
        assert eng.run_on_engine_thread(sched.prefill_token_budget) == 64
        long_prompt = prompt_ids(450, vocab, seed=11)  # 8 steps at 64 tokens
        shorts = [prompt_ids(60, vocab, seed=20 + i) for i in range(40)]  # 2 a step: a chunk is 128
        args = dict(max_tokens=2, temperature=0, ignore_eos=True)
        long = eng.submit(long_prompt, **args)  # first in the queue: the short prompts arrive behind it
        handles = [eng.submit(p, **args) for p in shorts]
        answers = [eng._collect(h) for h in handles]
        result = eng._collect(long)
        running.abort()
        done = long.request.finish_time
        before = sum(h.request.finish_time < done for h in handles)
        assert before >= 4, before  # they went ahead of it
        assert before <= 449 // 59 + 3, before  # no more than its own length of them (7 prompts)
        assert len(shorts) - before >= 15, before  # it was not starved by them
        eng.clear_prefix_cache()
        assert eng.generate([long_prompt], **args)[0].token_ids == result.token_ids
        assert [r[0].token_ids for r in (eng.generate([p], **args) for p in shorts)] == \
            [a.token_ids for a in answers]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_clearing_the_prefix_cache_gives_the_memory_back(tiny_model_dir, backend):
    """After a batch, the prefix cache holds its prompts in the lanes' page pools; clearing it drops the
    pools at once (an idle engine keeps no KV arrays), so MLX's active memory is back where it was before
    the batch, without waiting for another step."""
    import mlx.core as mx

    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), backend=backend)
    try:
        vocab = eng.model_info.vocab_size
        eng.generate([prompt_ids(20, vocab, seed=1)], max_tokens=2, temperature=0)  # warm-up
        eng.clear_prefix_cache()
        mx.clear_cache()
        before = mx.get_active_memory()
        eng.generate([prompt_ids(300, vocab, seed=2 + i) for i in range(8)], max_tokens=16, temperature=0,
                     ignore_eos=True)
        held = mx.get_active_memory() - before
        per_token = eng.model_info.kv_bytes_per_token()
        assert held >= 8 * 300 * per_token  # the prompts' KV, in the pools the prefix cache holds
        assert eng.clear_prefix_cache() >= 8 * 300 * per_token
        lanes = eng._scheduler.kv.batch.lanes
        assert all(lane.kv.layers[0].keys is None for lane in lanes)
        mx.clear_cache()
        assert mx.get_active_memory() - before < per_token * 64, mx.get_active_memory() - before
        # and the engine still serves, the pools rebuilt on demand
        again = eng.generate([prompt_ids(20, vocab, seed=1)], max_tokens=2, temperature=0)
        assert len(again[0].token_ids) == 2
    finally:
        eng.shutdown()
