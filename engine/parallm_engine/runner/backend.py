"""Pick the fast compute path for this machine before MLX is imported.

MLX's Linux CPU wheel bundles the netlib reference BLAS, whose fp32 GEMM is tens of times slower than an
optimised one. Loading an optimised CBLAS with global symbols *before* ``import mlx`` lets MLX resolve
``cblas_sgemm`` to it instead. This must run before anything imports ``mlx.core``, so the package
``__init__`` calls :func:`preload_blas` first thing.

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

from parallm_engine import settings
from parallm_engine.cpu_info import cpu_features

logger = logging.getLogger("parallm_engine")

# Candidate CBLAS libraries. Which is faster depends on the CPU (fp32 GEMMs of a decode step's shapes;
# docs/benchmarks-archive.md, "The previous round: BLAS per CPU, shared prefixes, measurement fixes"):
# - Intel: MKL (PyPI `mkl`, a dependency on Linux x86_64) runs the skinny decode GEMMs faster than
#   Debian's OpenBLAS 0.3.21.
# - AMD with AVX-512 (Zen 4/5): MKL takes its generic non-Intel code path and packs the weight matrix on
#   every call, and OpenBLAS 0.3.21 predates Zen 4 and picks its AVX2 Haswell kernels. OpenBLAS with its
#   AVX-512 SkylakeX kernels (OPENBLAS_CORETYPE) and both cores inside each GEMM runs a decode step faster
#   than MKL there, so :func:`blas_candidates` puts it first.
# PyPI `scipy-openblas32` does NOT work (its symbols are prefixed).
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


LATE_IMPORT_HINT = (
    "mlx.core was imported before parallm_engine, so MLX already bound its bundled reference BLAS and "
    "ParaLLM's fast BLAS cannot take effect (fp32 matmuls ~10-50x slower). Import parallm_engine (or "
    "parallm_integrations) before mlx in your script."
)

_preloaded: str | None = None
_preload_done = False
_preload_too_late = False  # mlx.core was already imported when the preload ran
_warned_slow_blas = False


def _mkl_candidates() -> list[str]:
    roots = {sys.prefix, os.path.dirname(os.path.dirname(sys.executable))}
    found: list[str] = []
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "lib", "libmkl_rt.so*")))
    return found


def _prefers_openblas() -> bool:
    vendor, flags = cpu_features()
    return vendor == "AuthenticAMD" and "avx512f" in flags


def blas_candidates() -> list[str]:
    """CBLAS libraries to try, best first for this CPU (see the note on the candidates above)."""
    mkl = _mkl_candidates()
    return _OPENBLAS_CANDIDATES + mkl if _prefers_openblas() else mkl + _OPENBLAS_CANDIDATES


def second_blas() -> str | None:
    """A CBLAS here of another library than the one :func:`preload_blas` picks (MKL beside OpenBLAS or the
    other way round), for running the engine's invariants under both; None where there is one only."""
    found = [p for p in blas_candidates() if os.path.exists(p)]
    if not found:
        return None
    first_is_mkl = _is_mkl(found[0])
    return next((p for p in found[1:] if _is_mkl(p) != first_is_mkl), None)


def _is_openblas(path: str | None) -> bool:
    return bool(path) and "openblas" in os.path.basename(path)


def _is_mkl(path: str | None) -> bool:
    return bool(path) and "mkl" in os.path.basename(path)


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules


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
    choice = settings.blas() or ""
    if choice.lower() == "none":
        return None
    if _mlx_imported():
        # MLX already bound the reference BLAS, about an order of magnitude slower on a matmul. backend_info
        # reports it and the engine warns (warn_if_slow_blas) with how to fix the import order.
        global _preload_too_late
        _preload_too_late = True
        return None
    candidates = [choice] if choice else blas_candidates()
    for path in candidates:
        if not os.path.exists(path):
            continue
        restore: dict[str, str | None] = {}
        if _is_mkl(path):
            _configure_mkl()
        elif _is_openblas(path):
            restore = _configure_openblas()
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:  # a broken library: try the next one
            logger.debug("could not load %s: %s", path, exc)
            continue
        finally:
            for key, value in restore.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        _preloaded = path
        return path
    return None


def _configure_openblas() -> dict[str, str | None]:
    """Settings OpenBLAS reads when it is loaded; returns the environment to restore afterwards.

    On an AVX-512 CPU it does not know (Debian's 0.3.21 and Zen 4) OpenBLAS falls back to its AVX2
    Haswell kernels; its SkylakeX AVX-512 kernels run there (Zen 4 implements every AVX-512 subset
    they use) and are faster on decode-shaped GEMMs. The core type is set only while
    ParaLLM's OpenBLAS loads, so an OPENBLAS_CORETYPE in the environment (some machines pin it for
    numpy's own OpenBLAS) still applies to everything else; PARALLM_OPENBLAS_CORETYPE picks another
    core type for ParaLLM's ("inherit": use OPENBLAS_CORETYPE as it is). Its threads default to one
    per core, right for the single lane it gets (``cpu_lanes``); lanes forced with
    PARALLM_DECODE_LANES share the cores instead."""
    restore: dict[str, str | None] = {}
    core = settings.openblas_coretype() or ""
    if not core:
        _, flags = cpu_features()
        core = "SkylakeX" if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags else "inherit"
    if core.lower() != "inherit":
        restore["OPENBLAS_CORETYPE"] = os.environ.get("OPENBLAS_CORETYPE")
        os.environ["OPENBLAS_CORETYPE"] = core
    lanes = settings.decode_lanes()
    if lanes is not None and lanes > 1:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, usable_cores() // lanes)))
    return restore


def set_blas_threads(n: int) -> bool:
    """Threads the preloaded CBLAS uses per call from now on (OpenBLAS or MKL, loaded with global symbols);
    False where neither answers (MLX's own BLAS, Accelerate)."""
    import ctypes

    lib = ctypes.CDLL(None)
    for name in ("openblas_set_num_threads", "MKL_Set_Num_Threads"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn(ctypes.c_int(max(1, n)))
            return True
    return False


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_lanes() -> int:
    """Decode lanes on the CPU backend (see ``decode_batch``).

    With OpenBLAS: one lane, and OpenBLAS's own threads use every core inside each GEMM (GEMMs are
    most of a decode step; one multi-threaded GEMM over all rows beats one single-threaded GEMM per lane
    by enough to pay for the elementwise work left on one core, and a single row's GEMV is faster on
    every core too). Otherwise one lane per core, at most 4: MLX runs each stream on one
    thread with scalar elementwise kernels, so parallel lanes are what uses the other cores, and MKL
    runs single-threaded inside each (``_configure_mkl``). ``PARALLM_DECODE_LANES`` overrides."""
    lanes = settings.decode_lanes()
    if lanes is not None:
        return lanes
    if _is_openblas(_preloaded):
        return 1
    return max(1, min(4, usable_cores()))


def _configure_mkl() -> None:
    """MKL picks its threading layer from the environment when it is first loaded.

    Each decode lane (``cpu_lanes``) calls the BLAS from its own thread (MLX's stream worker), and beside
    the lanes the engine thread builds the next step and delivers tokens while they compute. So MKL gets
    the cores left per lane once one is left for that host work: SEQUENTIAL where that is one, otherwise
    GNU OpenMP with that many threads. An OpenMP team with no core left free takes turns with the host
    threads, and decode runs several times slower though the team's GEMMs alone are faster
    (docs/benchmarks-archive.md, "One lane on a 2-core MKL machine; the compiled step measured fairly").
    Explicit MKL_THREADING_LAYER / MKL_NUM_THREADS settings win."""
    per_lane = mkl_threads_per_lane(usable_cores(), cpu_lanes())
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


def blas_threading(path: str | None = None) -> str:
    """How the preloaded CPU BLAS threads, for ``parallm info`` ("" where no CBLAS was preloaded)."""
    path = _preloaded if path is None else path
    if not path:
        return ""
    if _is_mkl(path):
        layer = os.environ.get("MKL_THREADING_LAYER", "").upper()
        if layer == "SEQUENTIAL":
            return "MKL sequential: one thread per decode lane"
        return f"MKL {layer or 'default'} threading, {os.environ.get('MKL_NUM_THREADS', 'all')} thread(s) per call"
    if _is_openblas(path):
        return f"OpenBLAS, {os.environ.get('OPENBLAS_NUM_THREADS') or usable_cores()} thread(s) per call"
    return ""


def mkl_threads_per_lane(cores: int, lanes: int) -> int:
    """MKL threads each decode lane may use: the cores but one (the host's), shared by the lanes."""
    return max(1, (cores - 1) // max(1, lanes))


def backend_info() -> BackendInfo:
    """Describe the active backend (imports mlx)."""
    from parallm_engine.models.mlx_install import require_backend_library

    require_backend_library()
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
            blas = _preloaded or ("reference (mlx imported first)" if _preload_too_late else "reference")
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
    if info.device == "cpu" and info.blas.startswith("reference") and not _warned_slow_blas:
        _warned_slow_blas = True
        logger.warning(LATE_IMPORT_HINT if _preload_too_late else BLAS_FIX_HINT)


# -- the engine's backend object ---------------------------------------------------------------------

BACKEND_NAMES = ("cpu-native", "cpu-mlx", "metal", "cuda")


@dataclass
class Backend:
    """Everything that differs between backends, decided once per engine. The engine configures the
    scheduler, the model runner and the memory budget from this object; nothing else looks at the device.

    - ``cpu-native``: MLX's CPU backend with ParaLLM's native kernels (attention, RMSNorm, SwiGLU,
      RoPE, the decode step's linear) and its pure-MLX CPU kernels where the native ones do not apply.
    - ``cpu-mlx``: MLX's own ops only, as on Metal and CUDA (every engine feature is on this path:
      the shared-prefix cascade is MLX ops). ``PARALLM_NATIVE=0 PARALLM_CPU_KERNELS=0`` or
      ``PARALLM_BACKEND=cpu-mlx`` selects it on a CPU; CI runs the engine invariants on it.
    - ``metal`` / ``cuda``: the GPU; native dtype, one decode lane, mlx-lm's fused attention.
    """

    name: str
    device: str  # "cpu", "gpu" (Metal) or "cuda"
    dtype: str  # weights and KV: "float32" on the CPU, "native" (the checkpoint's) on GPUs
    blas: str
    cpu_kernels: bool  # the engine's own attention / SwiGLU / RoPE (and native ones where built)
    decode_lanes: int
    memory_bytes: int  # what this device offers the process: RAM, Metal's working set, CUDA memory
    memory_source: str
    #: Whether a row's bits are independent of what shares its batch (``batch_invariance``); set once the
    #: model is loaded.
    batch_invariance: str = ""

    @property
    def prefill_chunk(self) -> int:
        """Default most prompt tokens in one prefill forward. A GPU's forward is short next to the
        host's per-forward work, so CUDA takes a much larger chunk than the CPU (docs/benchmarks-archive.md,
        "GPU (CUDA): the pure-MLX path on an NVIDIA H100"). Metal is unmeasured and keeps the CPU's."""
        return 4096 if self.name == "cuda" else 512

    @property
    def prefill_budget(self) -> int:
        """Default most prompt tokens prefilled per step (the step-time target may lower it)."""
        return 4 * self.prefill_chunk

    @property
    def attention(self) -> str:
        if self.name == "cpu-native":
            return "native (shared-prefix cascade native)"
        if self.cpu_kernels:
            return "engine MLX kernels (shared-prefix cascade in MLX ops)"
        if self.name == "cuda":
            from parallm_engine.runner import gpu_attention

            if gpu_attention.enabled_by_env():
                return "paged CUDA kernel for decode, mlx fast SDPA otherwise (shared-prefix cascade in MLX ops)"
        return "mlx fast SDPA (shared-prefix cascade in MLX ops)"

    def kv_budget(self, kv_memory: float | int | None = None) -> int:
        """The KV budget (running sequences and prefix cache) on this device: ``kv_memory`` as a fraction
        of its memory or bytes; a quarter by default (``memory_budget``)."""
        from parallm_engine.kv.memory_budget import resolve_kv_memory

        return resolve_kv_memory(kv_memory, self.memory_bytes)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["attention"] = self.attention
        return out

    def summary(self) -> str:
        return (f"backend={self.name} dtype={self.dtype} blas={self.blas} lanes={self.decode_lanes} "
                f"attention={self.attention} memory={self.memory_bytes / 2**30:.1f} GiB ({self.memory_source})"
                + (f" batch-invariant={self.batch_invariance.split(':')[0]}" if self.batch_invariance else ""))


def _queried_size(mx, module: str, keys: tuple[str, ...]) -> int | None:
    """A size from MLX's ``device_info()`` (top level or under ``mx.<module>``), guarded: None when the
    build has no such query or it fails."""
    for query in (getattr(mx, "device_info", None), getattr(getattr(mx, module, None), "device_info", None)):
        try:
            info = query() if query is not None else None
        except Exception:
            info = None
        for key in keys:
            if info and info.get(key):
                return int(info[key])
    return None


def device_memory(device: str, mx=None) -> tuple[int, str]:
    """(bytes, where they were read) for ``device``: Metal's recommended working set, CUDA's device
    memory, or physical RAM (also where an MLX build lacks the query)."""
    if mx is not None and device == "gpu":
        size = _queried_size(mx, "metal", ("max_recommended_working_set_size", "memory_size"))
        if size:
            return size, "metal working set"
    if mx is not None and device == "cuda":
        size = _queried_size(mx, "cuda", ("total_memory", "memory_size"))
        if size:
            return size, "cuda device memory"
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "system RAM"
    except (ValueError, OSError, AttributeError):
        return 8 << 30, "assumed 8 GiB"


def choose_backend(name: str | None = None) -> Backend:
    """The backend object for a new engine: ``name`` (one of :data:`BACKEND_NAMES`), else
    ``PARALLM_BACKEND``, else the device MLX runs on, with the CPU kernels unless turned off."""
    import mlx.core as mx

    info = backend_info()
    name = name or settings.backend_name()
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; one of {', '.join(BACKEND_NAMES)}")
    if name in ("metal", "cuda") and name != {"gpu": "metal", "cuda": "cuda"}.get(info.device):
        raise ValueError(f"backend {name!r} is not available here (MLX runs on {info.device})")
    if info.device == "cpu":
        kernels = name != "cpu-mlx" and settings.cpu_kernels()
        if name is None:
            from parallm_engine import native

            name = "cpu-native" if kernels and native.enabled_by_env() and native.supported_platform() \
                else "cpu-mlx"
        if name == "cpu-native" and not kernels:
            name = "cpu-mlx"
        lanes = cpu_lanes()
    else:
        name, kernels, lanes = ("metal" if info.device == "gpu" else "cuda"), False, 1
    memory, source = device_memory(info.device, mx)
    return Backend(name=name, device=info.device, dtype=info.dtype, blas=info.blas, cpu_kernels=kernels,
                   decode_lanes=lanes, memory_bytes=memory, memory_source=source)
