"""The server killed (SIGKILL) under load and started again: a stream in progress fails at once with a typed
error, idempotent calls from ChatParaLLM(base_url=...) and ParaLLMLlamaIndex(base_url=...) retry with
backoff (``max_retries``) until the new server answers, and nothing hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from parallm_bench.server_process import free_port, wait_healthy
from parallm_integrations import ChatParaLLM
from parallm_integrations.errors import EngineDeadError


def _start(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parallm_engine.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.timeout(600)
def test_kill_and_restart_under_load():
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    procs = [_start(port)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs[0], timeout=240, name="parallm serve")
        streaming = ChatParaLLM(base_url=url, temperature=0, max_tokens=400, max_retries=0)
        chunks = streaming.stream("Tell me a very long story about a lighthouse keeper.")
        assert next(chunks).content is not None  # the answer has started
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(30)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="mid-answer"):
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 30  # fails promptly, never hangs

        # Down now; a new server comes up a few seconds later while the clients retry with backoff.
        def restart():
            time.sleep(2)
            procs.append(_start(port))

        threading.Thread(target=restart, daemon=True).start()
        llm = ChatParaLLM(base_url=url, temperature=0, max_tokens=8, max_retries=10)
        assert llm.invoke("What is the capital of France?").content
        li = ParaLLMLlamaIndex(base_url=url, temperature=0, max_tokens=8, max_retries=10)
        assert li.complete("The capital of France is").text is not None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
