"""`parallm bench`'s transformers peer: torch + transformers' static batched ``generate`` on the engine's
exact weights, in a process of its own (``peer_worker``; ``$PARALLM_PEER_PYTHON`` for a venv with torch)."""

from __future__ import annotations

import functools
import json
import os

import mlx.core as mx


def _peer_python() -> str:
    """The interpreter the transformers peer runs in: ``$PARALLM_PEER_PYTHON`` (a venv that has torch,
    kept apart from ParaLLM's), else this one."""
    import sys

    return os.environ.get("PARALLM_PEER_PYTHON", "").strip() or sys.executable


def torch_available() -> bool:
    return _has_torch(_peer_python())


@functools.lru_cache(maxsize=None)
def _has_torch(python: str) -> bool:
    """Whether ``python`` can import torch and transformers (asked once per interpreter: another
    interpreter's answer costs a process importing torch)."""
    import importlib.util
    import subprocess
    import sys

    if python == sys.executable:
        return importlib.util.find_spec("torch") is not None
    try:
        return subprocess.run([python, "-c", "import torch, transformers"], capture_output=True,
                              timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def generate(model_dir, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict | None:
    """transformers' static batched ``generate`` on ``model_dir`` (``peer_worker``, in its own process
    so that torch runs as a user would run it, not beside MLX's threads and BLAS): the worker's
    ``tokens`` / ``wall_s`` / ``threads``. None without torch."""
    import subprocess
    import tempfile

    if not torch_available():
        return None
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_worker.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(prompts, fh)
    try:
        done = subprocess.run([_peer_python(), worker, str(model_dir), fh.name, str(new_tokens), dtype],
                              capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(fh.name)
    if done.returncode != 0:
        raise RuntimeError(f"transformers peer ({dtype}) failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_dir_with_fp32(engine, tmpdir) -> str:
    """An HF directory holding the engine's exact (dequantised fp32) weights for transformers."""
    import json as _json
    import shutil
    from pathlib import Path

    out = Path(tmpdir)
    src = engine.model_info.path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    cfg = dict(engine.model_info.config)
    for k in ("quantization", "quantization_config", "gguf_source"):
        cfg.pop(k, None)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(_json.dumps(cfg))
    from parallm_engine.runner.weights_dtype import named_weights

    weights = {k: v.astype(mx.float32) for k, v in named_weights(engine.model).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return str(out)
