"""A server as a child process: a free local port to start it on, and waiting until its ``/health`` answers.

Shared by whatever starts ``parallm serve`` (or another OpenAI-compatible server) as a process of its own:
the soak benchmark, the llama.cpp comparison and the server-restart test. In-process servers use
:class:`parallm_engine.serve.server.ServerThread` instead.
"""

from __future__ import annotations

import socket
import subprocess
import time


class ServerExited(RuntimeError):
    """The server process ended before it became healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick); closed again, for a server to bind."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 240.0,
                 interval: float = 0.3, name: str = "the server") -> None:
    """Return once ``GET {url}/health`` answers 200. :class:`ServerExited` if ``proc`` ends first,
    ``TimeoutError`` after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerExited(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not become healthy in {timeout:.0f} s")
        time.sleep(interval)
