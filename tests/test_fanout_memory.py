"""A fan-out over a long shared prefix holds each KV byte about once, on the native and the pure-MLX
path: 32 requests over a 2,000-token prefix hold at most 1.2 x (prefix + every row's own prompt and
output tokens) x bytes per token while they decode together (``kv_bytes_held``: the batch, a shared
prefix unless it is the radix tree's own arrays, and the tree), and every answer equals that request
run alone. (Until paged KV lets the tree and a row share blocks, the first request, decoding alone
before the others join, holds its own copy of the prefix beside the tree's.)

The first request of such a fan-out prefills alone (the others wait for its prefix to be cached) and
joins the batch with its whole context; when the others join, it gives up its own copy of the prefix
and reads the shared one (``PagedLaneKV.share_rows``: its prefix pages are freed).
"""

from __future__ import annotations

import json
import shutil

import pytest

from parallm_engine import Engine

PREFIX = 2000
ROWS = 32
OUT = 12


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, tiny_model_dir):
    """The session's tiny llama with a 4,096-token context (same weights and tokenizer)."""
    out = tmp_path_factory.mktemp("tiny-llama-4k")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(config))
    return out


def _prompts(engine) -> tuple[list[int], list[list[int]]]:
    text = " ".join(f"Record {i}: the value of key{i} is {i * 7 % 101}." for i in range(400))
    prefix = engine.encode(text)[:PREFIX]
    assert len(prefix) == PREFIX
    return prefix, [prefix + engine.encode(f" Question {i}: what is key{i * 3}?", add_special_tokens=False)
                    for i in range(ROWS)]


@pytest.mark.parametrize("backend", ["cpu-native", "cpu-mlx"])
def test_fan_out_over_2000_tokens_holds_each_byte_once(long_model_dir, backend):
    eng = Engine(str(long_model_dir), backend=backend)
    try:
        prefix, prompts = _prompts(eng)
        held_at_full_batch = []
        record = eng._scheduler.stats.on_step

        def on_step(running, kv_bytes, held=None):  # the engine's own gauge, read at every step
            if running == ROWS:
                held_at_full_batch.append(held)
            record(running, kv_bytes, held)

        eng._scheduler.stats.on_step = on_step
        results = eng.generate(prompts, max_tokens=OUT, temperature=0, ignore_eos=True)
        stats = eng.stats()
        per_token = eng.model_info.kv_bytes_per_token()
        own = sum(len(p) - PREFIX for p in prompts) + sum(len(r.token_ids) for r in results)
        bound = 1.2 * (PREFIX + own) * per_token
        assert held_at_full_batch and max(held_at_full_batch) <= bound, (max(held_at_full_batch), bound)
        # Before the others join, the first request decodes alone with its whole context while the
        # radix tree holds the prefix too: one extra copy of the prefix, never more.
        assert 0 < stats["peak_kv_bytes_held"] <= 1.2 * (2 * PREFIX + own) * per_token
        # Four of them again, each alone on a cold engine: the same tokens.
        cold = Engine(str(long_model_dir), backend=backend, enable_prefix_cache=False)
        try:
            for i in (0, 1, 17, 31):
                alone = cold.generate([prompts[i]], max_tokens=OUT, temperature=0, ignore_eos=True)[0]
                assert alone.token_ids == results[i].token_ids, i
        finally:
            cold.shutdown()
    finally:
        eng.shutdown()


def test_a_running_row_gives_up_its_copy_of_the_prefix(long_model_dir):
    """One request runs alone with its whole context; requests continuing its prefix arrive while it
    decodes: it switches to the shared copy (its row shrinks to its own tokens) and every request's
    tokens equal its run alone."""
    eng = Engine(str(long_model_dir), decode_lanes=1)
    try:
        prefix, prompts = _prompts(eng)
        first = eng.submit(prompts[0], max_tokens=40, temperature=0, ignore_eos=True)
        stream = iter(first)
        next(stream)  # decoding, alone, its row holding all ~2,010 tokens
        sched = eng._scheduler
        assert eng.run_on_engine_thread(lambda: sched.batch.shared is None and len(sched.running) == 1)
        later = [eng.submit(p, max_tokens=OUT, temperature=0, ignore_eos=True) for p in prompts[1:4]]
        later_tokens = [eng._collect(h).token_ids for h in later]
        first_tokens = list(eng._collect(first).token_ids)
        held_rows = eng.stats()["peak_kv_bytes"]
        per_token = eng.model_info.kv_bytes_per_token()
        # Without the switch every row would be >= 2,000 columns: 4 rows x 2,000 tokens.
        assert held_rows < 2 * PREFIX * per_token
        solo = Engine(str(long_model_dir), decode_lanes=1, enable_prefix_cache=False)
        try:
            assert first_tokens == solo.generate([prompts[0]], max_tokens=40, temperature=0,
                                                 ignore_eos=True)[0].token_ids
            for p, got in zip(prompts[1:4], later_tokens):
                assert got == solo.generate([p], max_tokens=OUT, temperature=0, ignore_eos=True)[0].token_ids
        finally:
            solo.shutdown()
    finally:
        eng.shutdown()
