"""``parallm top`` under tmux (issue 76): attached to a real server on loopback with a key, it starts, shows the
rows of a running fan-out on the default model, and exits on ``q``."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from parallm_engine.serve.server import ServerThread, create_app

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
KEY = "top-key"


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _wait(check, timeout: float, what: str, session: str):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; the screen:\n{_pane(session)}"
        time.sleep(0.2)


def test_top_shows_a_running_fan_out_and_quits_on_q(engine):
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Count to fifty, number {i}."}])
               for i in range(8)]
    session = f"parallm-top-{uuid.uuid4().hex[:8]}"
    with ServerThread(create_app(engine=engine, api_key=KEY)) as srv:
        handles = []
        env = {**os.environ, "PARALLM_API_KEY": KEY}
        command = shlex.join([sys.executable, "-m", "parallm_engine.cli", "top", "--url", srv.url, "--interval", "0.3"])
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", command],
                       check=True, env=env)
        try:
            _wait(lambda: "batch now" in _pane(session), 30, "top to start", session)
            # long enough to be on screen however slow the machine (aborted once seen)
            handles += [engine.submit(p, max_tokens=4000, ignore_eos=True) for p in prompts]
            # the header counts the rows; the table shows those that fit under the prefix table (the session's
            # shared engine holds many prefixes by now), at least one of them
            _wait(lambda: "rows: 8 decoding" in (pane := _pane(session)) and " decode " in pane, 60,
                  "the fan-out's 8 rows decoding", session)
            screen = _pane(session)
            print(screen)
            assert "ParaLLM top" in screen and "tok/s" in screen and "KV held" in screen
            subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
            _wait(lambda: subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0,
                  10, "top to exit on q", session)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
            for h in handles:  # the fan-out was only there to be seen
                h.abort()
