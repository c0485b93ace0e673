"""Every ``PARALLM_*`` environment variable the engine reads, parsed here and nowhere else.

One meaning of on / off for every switch: ``1 / true / yes / on`` and ``0 / false / no / off`` (any case,
surrounding spaces ignored); an empty or unset variable takes the default; any other value is ignored
with a warning naming it. Values are read when asked for (an ``Engine`` built after a change sees it),
never cached. Explicit ``Engine(...)`` / CLI arguments win over these; the variables are for settings a
user cannot pass (the BLAS, chosen before MLX is imported) and for tests and measurements.

This module imports nothing of MLX: the BLAS preload (``runner.backend``) reads it before MLX loads.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("parallm_engine")

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

#: name -> what it sets (docs/getting-started.md lists them: tests/test_settings.py holds the two together).
VARIABLES = {
    "PARALLM_BACKEND": "engine backend: cpu-native, cpu-mlx, metal or cuda (default: the device's)",
    "PARALLM_BLAS": "the CBLAS preloaded before MLX on Linux: a library path, or none (MLX's reference BLAS)",
    "PARALLM_OPENBLAS_CORETYPE": "OpenBLAS core type for ParaLLM's OpenBLAS (default SkylakeX on AVX-512; inherit)",
    "PARALLM_DECODE_LANES": "decode lanes on the CPU (default: one with OpenBLAS, one per core otherwise)",
    "PARALLM_CPU_KERNELS": "switch: the engine's CPU kernels (default on; off = the pure-MLX path)",
    "PARALLM_NATIVE": "switch: ParaLLM's native C++ CPU kernels (default on)",
    "PARALLM_NATIVE_SOURCE": "a development copy of the native kernels' source",
    "PARALLM_NATIVE_CXXFLAGS": "extra compiler flags for the native kernels",
    "PARALLM_NATIVE_DIR": "where built native kernels are cached (default ~/.cache/parallm/native)",
    "PARALLM_NATIVE_THREADS": "threads of the native kernels (read by kernels.cpp itself; default the cores)",
    "PARALLM_BATCH_INVARIANT": "switch: pad the CPU BLAS's small products so rows are batch-invariant (default on)",
    "PARALLM_FUSE_PREFILL": "switch: a prompt's chunk in the decode step's forward (default on; Engine(fuse_prefill=...))",
    "PARALLM_COMPILE_DECODE": "switch: the compiled decode step (default off; Engine(compile_decode=...))",
    "PARALLM_DECODE_WORKING_SET": "switch: keep the decode working set between steps (default on; Engine(decode_working_set=...))",
    "PARALLM_PIPELINE_MICRO_BATCHES": "switch: a distributed pipeline's decode batch as one micro-batch per stage (default off)",
    "PARALLM_GPU_PAGED_ATTENTION": "switch: the paged CUDA decode kernel (default on)",
    "PARALLM_GPU_SHARED_PREFIX": "kernel (default) or cascade: where a shared prefix is read on CUDA",
    "PARALLM_WEIGHTS_DTYPE": "CPU weight storage: float32, bfloat16 or bfloat16-matmul",
    "PARALLM_KV_BITS": "KV stored at 8 or 4 bits (default unquantized)",
    "PARALLM_KV_DISK": "the prefix cache's disk tier: its size cap (e.g. 8GiB), 0 turns it off (default on)",
    "PARALLM_KV_DISK_DIR": "where the disk tier keeps its blocks (default: kv/ in ParaLLM's cache directory)",
    "PARALLM_STEP_TRACE": "a file to append one JSON line per engine step to",
    "PARALLM_OTEL": "OpenTelemetry spans per request: 1 on, 0 off (default: on when a tracer provider is set)",
    "PARALLM_CACHE_DIR": "ParaLLM's cache directory (default ~/.cache/parallm)",
    "PARALLM_API_KEYS": "the server's API keys, comma-separated",
    "PARALLM_API_KEY": "one more server API key",
    # Read by the integrations' fields (they import without the engine), listed here to be documented once.
    "PARALLM_BASE_URL": "an OpenAI-compatible server the integrations call instead of the in-process engine",
}


def text(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    _known(name)
    value = os.environ.get(name, "").strip()
    return value or None


def flag(name: str, default: bool) -> bool:
    """A switch: True for ``ON`` values, False for ``OFF`` ones, ``default`` when unset or not understood."""
    raw = text(name)
    if raw is None:
        return default
    low = raw.lower()
    if low in ON:
        return True
    if low in OFF:
        return False
    logger.warning("ignoring %s=%r: use one of %s (on) or %s (off)", name, raw, "/".join(ON), "/".join(OFF))
    return default


def integer(name: str) -> int | None:
    """A whole number, or None when unset or not one (with a warning)."""
    raw = text(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        logger.warning("ignoring %s=%r (not an integer)", name, raw)
        return None


def choice(name: str, options: tuple[str, ...], default: str) -> str:
    """One of ``options`` (any case), ``default`` when unset or not one of them (with a warning)."""
    raw = text(name)
    if raw is None:
        return default
    if raw.lower() in options:
        return raw.lower()
    logger.warning("ignoring %s=%r: one of %s", name, raw, ", ".join(options))
    return default


def _known(name: str) -> None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of ParaLLM's settings (parallm_engine/settings.py)")


# -- the engine's settings, by name ----------------------------------------------------------------

def backend_name() -> str | None:
    return text("PARALLM_BACKEND")


def blas() -> str | None:
    return text("PARALLM_BLAS")


def openblas_coretype() -> str | None:
    return text("PARALLM_OPENBLAS_CORETYPE")


def decode_lanes() -> int | None:
    """Lanes forced by the environment (at least 1), or None."""
    lanes = integer("PARALLM_DECODE_LANES")
    return None if lanes is None else max(1, lanes)


def cpu_kernels() -> bool:
    return flag("PARALLM_CPU_KERNELS", True)


def pipeline_micro_batches() -> bool:
    """A distributed pipeline splits its decode batch into one micro-batch per stage (docs/distributed.md)."""
    return flag("PARALLM_PIPELINE_MICRO_BATCHES", False)


def native() -> bool:
    return flag("PARALLM_NATIVE", True)


def batch_invariant() -> bool:
    return flag("PARALLM_BATCH_INVARIANT", True)


def fuse_prefill() -> bool:
    return flag("PARALLM_FUSE_PREFILL", True)


def compile_decode() -> bool:
    return flag("PARALLM_COMPILE_DECODE", False)


def decode_working_set() -> bool:
    return flag("PARALLM_DECODE_WORKING_SET", True)


def gpu_paged_attention() -> bool:
    return flag("PARALLM_GPU_PAGED_ATTENTION", True)


def gpu_shared_prefix() -> str:
    return choice("PARALLM_GPU_SHARED_PREFIX", ("kernel", "cascade"), "kernel")


def weights_dtype() -> str | None:
    return text("PARALLM_WEIGHTS_DTYPE")


_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}


def parse_size(text: str) -> int:
    """A size in bytes: ``4096``, ``512MiB``, ``8GiB``, ``2.5GB`` (raises ValueError otherwise)."""
    t = str(text).strip().lower().replace(" ", "")
    for unit, scale in _UNITS.items():
        if t.endswith(unit) and t[: -len(unit)]:
            return int(float(t[: -len(unit)]) * scale)
    value = float(t)
    if value < 0 or value != int(value):
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(value)


def kv_disk() -> int | None:
    """``PARALLM_KV_DISK`` as bytes (0: off), None when unset or not a size (logged)."""
    raw = text("PARALLM_KV_DISK")
    if raw is None:
        return None
    if raw.strip().lower() in OFF:
        return 0
    try:
        return parse_size(raw)
    except ValueError:
        logger.warning("ignoring PARALLM_KV_DISK=%r: not a size (e.g. 8GiB) or 0", raw)
        return None


def kv_disk_dir() -> str | None:
    return text("PARALLM_KV_DISK_DIR")


def kv_bits() -> str | None:
    return text("PARALLM_KV_BITS")


def step_trace() -> str | None:
    return text("PARALLM_STEP_TRACE")


def otel() -> bool | None:
    """OpenTelemetry spans per request (core/tracing.py): on (opentelemetry is imported if it was not), off
    (never), or unset: on when the process has set a tracer provider."""
    return flag("PARALLM_OTEL", None)


def cache_dir() -> str | None:
    return text("PARALLM_CACHE_DIR")


def native_source() -> str | None:
    return text("PARALLM_NATIVE_SOURCE")


def native_cxxflags() -> list[str]:
    return (text("PARALLM_NATIVE_CXXFLAGS") or "").split()


def native_dir() -> str | None:
    return text("PARALLM_NATIVE_DIR")


def api_keys() -> list[str]:
    """``PARALLM_API_KEYS`` (comma-separated) then ``PARALLM_API_KEY``, without blanks or repeats."""
    keys = [k.strip() for k in (text("PARALLM_API_KEYS") or "").split(",")]
    keys.append(text("PARALLM_API_KEY") or "")
    return [k for k in dict.fromkeys(keys) if k]
