"""One KV budget per engine: the running sequences and the prefix cache share it, the prefix cache gives
way first (no preemption while it has unpinned entries to evict), ``kv_memory`` as a fraction or
bytes, MLX's buffer cache / allocation / wired limits, and what ``stats()`` / ``/metrics`` report."""

from __future__ import annotations

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine.kv import memory_budget
from parallm_engine.errors import InvalidRequestError
from parallm_engine.kv.memory_budget import apply_mlx_limits, mlx_limits, resolve_kv_memory

from .conftest import settled_stats
from .model_zoo import prompt_ids
from .test_memory import _wait

GiB = 1 << 30


def test_kv_memory_fraction_or_bytes():
    assert resolve_kv_memory(None, 16 * GiB) == 4 * GiB
    assert resolve_kv_memory(0.5, 16 * GiB) == 8 * GiB
    assert resolve_kv_memory(3 * GiB, 16 * GiB) == 3 * GiB
    for bad in (0.0, 1.5, -1, 10, True, "1GiB", [1]):
        with pytest.raises(InvalidRequestError, match="kv_memory"):
            resolve_kv_memory(bad, 16 * GiB)


def test_cli_kv_memory_sizes():
    import argparse

    from parallm_engine.cli import _kv_memory

    assert _kv_memory("0.3") == 0.3
    assert _kv_memory("2GiB") == 2 * GiB
    assert _kv_memory("512MiB") == 512 << 20
    assert _kv_memory("1000000000") == 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        _kv_memory("lots")


class _FakeMX:
    """Records the limits set; ``set_wired_limit`` refuses large values, as macOS does."""

    def __init__(self, wired_max: int | None = None, wired: bool = True):
        self.calls: list[tuple[str, int]] = []
        self.wired_max = wired_max
        if not wired:
            self.set_wired_limit = None

    def set_cache_limit(self, n):
        self.calls.append(("cache", n))

    def set_memory_limit(self, n):
        self.calls.append(("memory", n))

    def set_wired_limit(self, n):
        if self.wired_max is not None and n > self.wired_max:
            raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than the maximum")
        self.calls.append(("wired", n))


@pytest.fixture
def clean_limits(monkeypatch):
    monkeypatch.setattr(memory_budget, "_applied", {})


def test_mlx_limits_per_device(clean_limits):
    cpu = mlx_limits("cpu", 24 * GiB, 6 * GiB, GiB)
    assert cpu == {"cache": int(1.5 * GiB)}  # a quarter of the KV budget; no allocation limit on the CPU
    metal = mlx_limits("gpu", 16 * GiB, 4 * GiB, 5 * GiB)
    assert metal == {"cache": GiB, "memory": 16 * GiB, "wired": 9 * GiB}
    assert mlx_limits("cuda", 80 * GiB, 20 * GiB, 16 * GiB) == {"cache": 5 * GiB, "memory": 80 * GiB}
    assert mlx_limits("cpu", 2 * GiB, 256 << 20, 0)["cache"] == memory_budget.CACHE_LIMIT_FLOOR


def test_working_sets_take_what_the_kv_budget_leaves_free():
    """The kept decode working sets (a copy of the running rows' own tokens where attention reads no pool):
    memory left beside the weights, the KV budget and a headroom, at most the budget, at least the buffer
    cache's share (what the engine allowed before)."""
    ws = memory_budget.working_set_bytes
    assert ws(24 * GiB, 6 * GiB, GiB) == 6 * GiB  # plenty free: as much as the rows could hold
    assert ws(16 * GiB, 8 * GiB, 5 * GiB) == memory_budget.buffer_cache_bytes(8 * GiB)  # nothing free: the floor
    free = int(16 * GiB * (1 - memory_budget.WORKING_SET_HEADROOM)) - 3 * GiB - 6 * GiB
    assert ws(16 * GiB, 6 * GiB, 3 * GiB) == free and memory_budget.buffer_cache_bytes(6 * GiB) < free < 6 * GiB


def test_the_kept_working_set_limit_follows_the_kv_budget(tiny_engine):
    """The decode batch's limit is the engine's working-set bytes within the KV budget in effect: an
    allocation failure that lowers the budget (memory_recovery) lowers it too."""
    from parallm_engine.core.engine import _weight_bytes

    sched = tiny_engine._scheduler
    config, kv = sched.config, sched.kv
    assert config.working_set_bytes == memory_budget.working_set_bytes(
        tiny_engine.backend.memory_bytes, config.kv_budget_bytes, _weight_bytes(tiny_engine.model))
    saved = config.kv_budget_bytes, config.working_set_bytes
    try:
        kv.reserve_decode()
        assert kv.batch.working_set_limit == max(memory_budget.buffer_cache_bytes(saved[0]),
                                                 min(saved[1], saved[0]))
        config.kv_budget_bytes, config.working_set_bytes = 4 * GiB, 16 * GiB
        kv.reserve_decode()
        assert kv.batch.working_set_limit == 4 * GiB
        config.kv_budget_bytes = 256 << 20  # lowered after a failure: the buffer cache's floor
        kv.reserve_decode()
        assert kv.batch.working_set_limit == memory_budget.CACHE_LIMIT_FLOOR
    finally:
        config.kv_budget_bytes, config.working_set_bytes = saved
        kv.reserve_decode()


def test_apply_never_lowers_another_engines_limit(clean_limits):
    fake = _FakeMX()
    apply_mlx_limits({"cache": 2 * GiB, "memory": 16 * GiB}, mx=fake)
    applied = apply_mlx_limits({"cache": GiB, "memory": 16 * GiB}, mx=fake)
    assert applied["cache"] == 2 * GiB and fake.calls[-2] == ("cache", 2 * GiB)


def test_apply_skips_what_the_build_or_os_refuses(clean_limits, caplog):
    fake = _FakeMX(wired_max=8 * GiB)
    applied = apply_mlx_limits({"cache": GiB, "wired": 9 * GiB}, mx=fake)
    assert "wired" not in applied and "could not set MLX wired limit" in caplog.text
    assert apply_mlx_limits({"wired": GiB}, mx=_FakeMX(wired=False)) == {"cache": GiB}


def test_prefix_cache_gives_way_before_any_preemption(tiny_engine, tiny_model_dir):
    """A budget the prefix cache has filled with earlier prompts: a batch that needs the room evicts
    them (least recently used first) and preempts nobody; the answers equal each request alone."""
    from parallm_engine import Engine

    vocab = tiny_engine.model_info.vocab_size
    per_token = tiny_engine.model_info.kv_bytes_per_token()
    budget = per_token * 1200
    eng = Engine(str(tiny_model_dir), kv_budget_bytes=budget, decode_lanes=1)
    try:
        old = [prompt_ids(200, vocab, seed=50 + i) for i in range(5)]
        for p in old:  # one at a time: each leaves its prompt in the prefix cache
            eng.generate([p], max_tokens=1, temperature=0, ignore_eos=True)
        filled = settled_stats(eng)["prefix_cache"]["bytes"]
        assert filled >= 700 * per_token  # the cache holds most of the budget
        new = [prompt_ids(60, vocab, seed=80 + i) for i in range(8)]
        results = eng.generate(new, max_tokens=40, temperature=0, ignore_eos=True)
        stats = eng.stats()
        assert stats["preemptions"] == 0
        assert stats["memory"]["prefix_cache_evicted_for_rows_bytes"] > 0
        assert stats["prefix_cache"]["evictions"] > 0
        alone = [tiny_engine.generate([p], max_tokens=40, temperature=0, ignore_eos=True)[0].token_ids for p in new]
        assert [r.token_ids for r in results] == alone
        # Held never exceeded the budget by more than the rows a step adds past the watermark.
        assert stats["peak_kv_bytes_held"] <= budget + 8 * 16 * per_token
        mem = stats["memory"]
        assert mem["kv_budget_bytes"] == budget and mem["mlx_active_bytes"] > 0
        assert mem["prefix_cache_pinned_bytes"] == 0
    finally:
        eng.shutdown()


def test_memory_gauges_on_metrics(tiny_engine):
    from parallm_engine.serve.metrics import render_engine_stats

    tiny_engine.generate(["hello"], max_tokens=2)
    assert _wait(lambda: "memory" in tiny_engine.stats())
    text = "\n".join(render_engine_stats(tiny_engine.stats(), "m"))
    for name in ("parallm_kv_budget_bytes", "parallm_prefix_cache_limit_bytes", "parallm_mlx_cache_memory_bytes",
                 "parallm_mlx_active_memory_bytes", "parallm_prefix_cache_pinned_bytes"):
        assert f"\n{name}{{" in text or text.startswith(f"{name}{{"), name


def test_bad_priority_does_not_leak_a_queue_slot(tiny_engine):
    before = tiny_engine.stats()["waiting"]
    for _ in range(3):
        with pytest.raises(InvalidRequestError):
            tiny_engine.submit("hi", max_tokens=1, priority="high")
    assert tiny_engine.stats()["waiting"] == before
