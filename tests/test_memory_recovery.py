"""An allocation failure inside a step (MLX's "[metal::malloc] Unable to allocate", CUDA's or the CPU's)
fails no request that can still run: everything in flight is preempted and resumes with the tokens it
would have produced, greedy and seeded; only a request that keeps failing alone gets OutOfMemoryError.

The failure is injected by wrapping this engine's model object (the forward raises MLX's Metal
allocation message on chosen calls), since a CPU machine cannot be made to run out of memory on cue.
"""

from __future__ import annotations

import pytest

from parallm_engine import Engine, OutOfMemoryError
from parallm_engine.core.memory_recovery import MAX_STREAK, is_allocation_failure

from .conftest import settled_stats

METAL_OOM = "[metal::malloc] Unable to allocate 4294967296 bytes which is greater than the maximum allowed"


class FailingForward:
    """The engine's model, whose forward raises an allocation failure on the calls in ``fail_on`` (or on
    every call while ``always`` is set)."""

    def __init__(self, model, fail_on=(), always=False):
        self._model, self.fail_on, self.always, self.calls = model, set(fail_on), always, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.always or self.calls in self.fail_on:
            raise RuntimeError(METAL_OOM)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture
def eng(tiny_model_dir):
    e = Engine(str(tiny_model_dir))
    yield e
    e.shutdown()


def _install(eng, **kw) -> FailingForward:
    sched = eng._scheduler
    model = sched.model._model if isinstance(sched.model, FailingForward) else sched.model
    wrapper = FailingForward(model, **kw)

    def swap():  # prefill (the scheduler) and decode (its runner) both run the model
        sched.model = sched.runner.model = wrapper

    eng.run_on_engine_thread(swap)
    return wrapper


def _requests(eng):
    prompts = [f"Request {i}: tell me about number {i}." for i in range(8)]
    sampling = [dict(temperature=0) if i % 2 else dict(temperature=0.9, seed=100 + i) for i in range(8)]
    handles = [eng.submit(p, max_tokens=24, ignore_eos=True, **s) for p, s in zip(prompts, sampling)]
    return [eng._collect(h).token_ids for h in handles]


def test_failed_steps_preempt_and_every_request_completes_with_its_tokens(eng):
    want = _requests(eng)
    eng.clear_prefix_cache()
    wrapper = _install(eng, fail_on={4, 9, 10, 23})  # during prefill and decode, twice in a row once
    got = _requests(eng)
    assert wrapper.calls > 23
    assert got == want
    stats = settled_stats(eng)
    assert stats["allocation_failures"] == 4 and stats["preemptions"] > 0
    assert stats["kv_bytes"] == 0 and stats["in_flight"] == 0
    # The lowered budget grows back over healthy steps: 1/64 of it per step, so 100 decode steps restore
    # it however few steps the recovery above happened to take.
    sched = eng._scheduler
    lowered = eng.run_on_engine_thread(lambda: sched.config.kv_budget_bytes)
    configured = eng.run_on_engine_thread(lambda: sched.kv_budget_configured)
    assert configured is not None and lowered < configured
    eng.generate(["Healthy steps."] * 4, max_tokens=100, temperature=0, ignore_eos=True)
    assert eng.run_on_engine_thread(lambda: sched.kv_budget_configured is None)
    assert eng.run_on_engine_thread(lambda: sched.config.kv_budget_bytes) == configured


def test_a_request_that_fails_alone_gets_out_of_memory_and_the_engine_serves_on(eng):
    want = eng.generate(["After the failure."], max_tokens=8, temperature=0)[0].token_ids
    _install(eng, always=True)
    handle = eng.submit("This one cannot fit.", max_tokens=8, temperature=0)
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        eng._collect(handle)
    assert eng.stats()["allocation_failures"] == MAX_STREAK
    _install(eng)  # memory is back
    assert eng.generate(["After the failure."], max_tokens=8, temperature=0)[0].token_ids == want
    assert eng.is_alive


def test_other_errors_are_not_mistaken_for_allocation_failures():
    assert is_allocation_failure(MemoryError())
    assert is_allocation_failure(RuntimeError(METAL_OOM))
    assert is_allocation_failure(RuntimeError("CUDA error: out of memory"))
    assert not is_allocation_failure(RuntimeError("[matmul] shapes do not match"))
    assert not is_allocation_failure(ValueError("Unable to allocate"))
