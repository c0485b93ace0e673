"""``pip install parallm-integrations`` without the engine: ``ChatParaLLM`` / ``ParaLLM`` /
``ParaLLMLlamaIndex`` with ``base_url=`` pass their suite (``remote_without_mlx_suite.py``) in a child
process where neither ``mlx`` nor ``parallm_engine`` can be imported (the ``engine`` extra left out),
and the part that differs when the engine is installed but ``import mlx`` fails (errors and sampling
checks from the engine's plain-Python modules) in a second child. The server is ``parallm serve`` on this
session's engine, in this process, which does have MLX; the children compare their answers with what
that engine answers in-process. ``PARALLM_TEST_REMOTE_PYTHON`` runs the children with another interpreter,
e.g. a venv where only ``pip install parallm-integrations pytest pytest-asyncio pytest-timeout`` was run."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallm_engine import errors as engine_errors
from parallm_engine.serve.server import ServerThread

HERE = Path(__file__).parent
KEY = "no-mlx-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(engine) -> dict:
    """What the in-process engine answers to the suite's greedy requests, and the engine's error classes."""
    chat = engine.chat(QUESTION, max_tokens=10, temperature=0)
    (story,) = engine.generate(["Once upon a time"], max_tokens=6, temperature=0)
    errors = {}
    for name, cls in vars(engine_errors).items():
        if isinstance(cls, type) and issubclass(cls, engine_errors.ParaLLMError):
            errors[name] = {"mro": [c.__name__ for c in cls.__mro__],
                            "init": list(inspect.signature(cls.__init__).parameters)}
    return {
        "chat_text": chat.text, "chat_prompt_tokens": chat.usage.prompt_tokens,
        "chat_completion_tokens": chat.usage.completion_tokens,
        "completion_text": story.text, "completion_tokens": story.usage.completion_tokens,
        "hello_ids": engine.encode("Hello world", add_special_tokens=False),
        "question_tokens": len(engine.apply_chat_template(QUESTION, add_generation_prompt=False)),
        "context_window": engine.context_window, "model_name": engine.model_name, "errors": errors,
    }


@pytest.mark.parametrize(("blocked", "selection"), [
    ("mlx,mlx_lm,parallm_engine", None),
    ("mlx,mlx_lm", "errors or chat_model_invoke or llama_index_endpoints"),
], ids=["engine-not-installed", "mlx-unimportable"])
def test_remote_classes_pass_their_suite_without_mlx(server, reference, blocked, selection):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "no_mlx"), os.environ.get("PYTHONPATH")])),
        "PARALLM_BLOCK_IMPORTS": blocked,
        "PARALLM_TEST_NO_ENGINE": "1" if "parallm_engine" in blocked else "0",
        "PARALLM_TEST_BASE_URL": server.base_url,
        "PARALLM_TEST_API_KEY": KEY,
        "PARALLM_TEST_REFERENCE": json.dumps(reference),
    }
    env.pop("PARALLM_BASE_URL", None)
    env.pop("PARALLM_API_KEY", None)
    proc = subprocess.run(
        [os.environ.get("PARALLM_TEST_REMOTE_PYTHON") or sys.executable, "-m", "pytest", str(HERE / "remote_without_mlx_suite.py"), "-q", "-p", "no:cacheprovider",
         "--noconftest", "-o", "timeout=115", *(["-k", selection] if selection else [])],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=118,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "error" not in summary, summary
