"""Importing the engine (and through it transformers, for tokenizers) prints nothing a user cannot act on:
transformers' "PyTorch was not found" notice is dropped; its other messages still pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_pytorch_notice_but_other_transformers_messages_pass():
    code = ("import parallm_engine, logging\n"
            "import mlx_lm.utils  # imports transformers, as loading a model does\n"
            "import transformers\n"
            "logging.getLogger('transformers').warning('a warning someone can act on')\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'engine'}")
    # A fresh user process: earlier tests imported mlx-vlm, which sets these in os.environ on import.
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    env.pop("TRANSFORMERS_VERBOSITY", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr
    assert "a warning someone can act on" in out.stderr
