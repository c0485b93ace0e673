"""Pick the fast compute path for this machine before MLX is imported.

MLX's Linux CPU wheel bundles the netlib reference BLAS (~5 GFLOP/s fp32 GEMM). Loading an optimised
CBLAS with global symbols *before* ``import mlx`` lets MLX resolve ``cblas_sgemm`` to it instead
(~300 GFLOP/s on the 2-core CI machines). This must run before anything imports ``mlx.core``, so the
package ``__init__`` calls :func:`preload_blas` first thing.

Dtypes: on the CPU backend float16/bfloat16 and quantized matmuls have no fast kernels, so weights
run in float32; on Metal and CUDA the checkpoint's native dtype is right.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import sys
from dataclasses import asdict, dataclass

logger = logging.getLogger("parallm_engine")

# Candidate CBLAS libraries, best first. MKL (PyPI `mkl`, a dependency on Linux x86_64) runs the skinny
# decode GEMMs 2-4x faster than Debian's OpenBLAS 0.3.21 here (measured: (32x576)@(576x1536) 0.38 ms vs
# 1.5 ms); OpenBLAS (`apt-get install libopenblas0-pthread`) is the fallback. PyPI `scipy-openblas32`
# does NOT work (its symbols are prefixed).
_OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]

BLAS_FIX_HINT = (
    "MLX is using its bundled reference BLAS, which is ~50x slower for fp32 matmuls. "
    "Fix: `sudo apt-get install libopenblas0-pthread` (Debian/Ubuntu) or `pip install mkl`, "
    "or point PARALLM_BLAS at a CBLAS shared library."
)


@dataclass
class BackendInfo:
    device: str  # "cpu", "gpu" (Metal) or "cuda"
    platform: str
    blas: str  # path of the preloaded CBLAS, "accelerate", "cublas" or "reference"
    dtype: str  # dtype weights run in on this backend
    mlx_version: str

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"backend={self.device} dtype={self.dtype} blas={self.blas} "
            f"mlx={self.mlx_version} platform={self.platform}"
        )


_preloaded: str | None = None
_preload_done = False
_warned_slow_blas = False


def _mkl_candidates() -> list[str]:
    roots = {sys.prefix, os.path.dirname(os.path.dirname(sys.executable))}
    found: list[str] = []
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "lib", "libmkl_rt.so*")))
    return found


def preload_blas() -> str | None:
    """Load an optimised CBLAS into the process with RTLD_GLOBAL. Idempotent.

    Returns the path loaded, or None (macOS uses Accelerate; nothing found; or disabled with
    PARALLM_BLAS=none). Must run before ``import mlx.core`` to have any effect.
    """
    global _preloaded, _preload_done
    if _preload_done:
        return _preloaded
    _preload_done = True
    if platform.system() != "Linux":
        return None
    choice = os.environ.get("PARALLM_BLAS", "").strip()
    if choice.lower() == "none":
        return None
    if "mlx.core" in sys.modules:
        logger.debug("mlx.core already imported; a BLAS preload now would have no effect")
    candidates = [choice] if choice else _mkl_candidates() + _OPENBLAS_CANDIDATES
    for path in candidates:
        if not os.path.exists(path):
            continue
        if "mkl" in os.path.basename(path):
            _configure_mkl()
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:  # a broken library: try the next one
            logger.debug("could not load %s: %s", path, exc)
            continue
        _preloaded = path
        return path
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_lanes() -> int:
    """Decode lanes on the CPU backend (see ``decode_batch``): one per core, at most 4.

    MLX runs each stream on one thread with scalar elementwise kernels, so parallel lanes are what
    uses the other cores; past 4 lanes each lane's batch gets too small for efficient GEMMs and the
    BLAS's own threads (``_configure_mkl``) use the remaining cores. ``PARALLM_DECODE_LANES`` overrides."""
    env = os.environ.get("PARALLM_DECODE_LANES", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            logger.warning("ignoring PARALLM_DECODE_LANES=%r (not an integer)", env)
    return max(1, min(4, usable_cores()))


def _configure_mkl() -> None:
    """MKL picks its threading layer from the environment when it is first loaded.

    Each decode lane (``cpu_lanes``) calls the BLAS from its own thread, so MKL gets the cores left per
    lane: SEQUENTIAL when that is one (always on 2 cores; GNU OpenMP threads spin-wait, and when another
    thread holds the other core a (32x576)@(576x1536) GEMM went from 0.5 ms to 8 ms), otherwise GNU
    OpenMP with cores // lanes threads. Explicit MKL_THREADING_LAYER / MKL_NUM_THREADS settings win."""
    per_lane = usable_cores() // cpu_lanes()
    if per_lane <= 1:
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
        return
    try:
        ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
        return
    os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
    os.environ.setdefault("MKL_NUM_THREADS", str(per_lane))


def backend_info() -> BackendInfo:
    """Describe the active backend (imports mlx)."""
    import mlx.core as mx

    if platform.system() == "Darwin" and mx.metal.is_available():
        device, blas = "gpu", "accelerate"
    elif _cuda_available(mx):
        device, blas = "cuda", "cublas"
    else:
        device = "cpu"
        if platform.system() == "Darwin":
            blas = "accelerate"
        else:
            blas = _preloaded or "reference"
    return BackendInfo(
        device=device,
        platform=f"{platform.system()}-{platform.machine()}",
        blas=blas,
        dtype=default_dtype_name(device),
        mlx_version=getattr(mx, "__version__", "unknown"),
    )


def _cuda_available(mx) -> bool:
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # older MLX builds without a CUDA backend
        return False


def default_dtype_name(device: str) -> str:
    """float32 on the CPU backend (only fast fp32 kernels there); native elsewhere."""
    return "float32" if device == "cpu" else "native"


def warn_if_slow_blas(info: BackendInfo) -> None:
    """Say once per process when the CPU path runs on the reference BLAS."""
    global _warned_slow_blas
    if info.device == "cpu" and info.blas == "reference" and not _warned_slow_blas:
        _warned_slow_blas = True
        logger.warning(BLAS_FIX_HINT)
