"""The engine thread dying (not one failed step, which fails only what is in flight and keeps serving:
test_engine) must raise in every caller waiting on it, sync or async, queued or running, and in every later
submit: nobody is left blocked."""

from __future__ import annotations

import asyncio
import threading

import pytest

from parallm_engine import EngineDeadError


def test_engine_thread_death_raises_in_every_waiting_caller(tiny_model_dir):
    from parallm_engine.core.engine import Engine

    eng = Engine(str(tiny_model_dir))
    try:
        eng.generate(["warm up"], max_tokens=2, temperature=0)
        in_step, release = threading.Event(), threading.Event()

        def dying_step():
            in_step.set()
            release.wait(30)
            # A BaseException escapes the loop's per-step recovery: the thread itself ends.
            raise SystemExit("simulated death of the engine thread")

        eng._scheduler.step = dying_step  # this engine instance only
        running = [eng.submit("a running request", max_tokens=64, temperature=0) for _ in range(2)]
        assert in_step.wait(30)
        queued = eng.submit("submitted while the thread is inside its last step", max_tokens=8)

        async def async_caller():
            handle = eng.submit("an async caller", loop=asyncio.get_running_loop(), max_tokens=8)
            release.set()
            return [d async for d in handle]

        with pytest.raises(EngineDeadError, match="died"):
            asyncio.run(asyncio.wait_for(async_caller(), 30))
        for handle in (*running, queued):
            with pytest.raises(EngineDeadError):
                list(handle)
        eng.core.thread.join(30)
        assert not eng.core.thread.is_alive() and not eng.is_alive
        with pytest.raises(EngineDeadError):
            eng.submit("after the death", max_tokens=2)
        assert eng.stats()["in_flight"] == 0
    finally:
        eng.shutdown(timeout=5)
