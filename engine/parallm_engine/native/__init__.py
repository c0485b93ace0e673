"""ParaLLM's native CPU kernels (``kernels.cpp``): MLX primitives compiled on the user's machine.

MLX's CPU elementwise kernels are scalar (``exp`` ~10 ns per element on x86 Linux) and its batched
matmul calls the BLAS once per batch entry, which is most of what a decode step spends outside its
GEMMs. ``kernels.cpp`` holds fused, vectorised replacements for the decode step's attention (with
the shared-prefix cascade), SwiGLU and RoPE, as MLX primitives that sit in the lazy graph like any
other op.

They are built with ``g++ -O3 -march=native`` against the installed MLX's headers and nanobind (its
ABI must match the one MLX's Python module was built with, nanobind 3.x; the types are shared
through nanobind's ``mlx`` domain), into a cache directory keyed by everything the binary depends on
(source, MLX, nanobind, Python, compiler, CPU flags). ``scripts/setup`` builds it once
(``python -m parallm_engine.native``); otherwise the first engine start does (~10 s). Where it
cannot be built (no compiler, no nanobind, not Linux) :func:`load` returns None and ``cpu_kernels``
keeps its pure-MLX versions. ``PARALLM_NATIVE=0`` turns it off; ``PARALLM_NATIVE_THREADS`` sets the
kernels' threads (default: the cores, up to 8); ``PARALLM_NATIVE_DIR`` the cache directory;
``PARALLM_NATIVE_CXXFLAGS`` adds compiler flags (``-mno-avx512f`` builds the AVX2 variant to test it);
``PARALLM_NATIVE_SOURCE`` builds another copy of ``kernels.cpp`` (kernel development).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from parallm_engine import settings
from parallm_engine.cpu_info import cpu_features

logger = logging.getLogger("parallm_engine")

MODULE = "_parallm_native"
SOURCE = Path(__file__).with_name("kernels.cpp")


def _source() -> Path:
    """The kernels' source: ``kernels.cpp`` here, or ``PARALLM_NATIVE_SOURCE`` (a development copy,
    built into its own cache entry like any other source)."""
    override = settings.native_source()
    return Path(override) if override else SOURCE
CXXFLAGS = ["-std=c++20", "-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared",
            "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx"]


def _cxxflags() -> list[str]:
    return CXXFLAGS + settings.native_cxxflags()


class NativeBuildError(RuntimeError):
    """The native kernels could not be compiled (the message says why)."""


def enabled_by_env() -> bool:
    return settings.native()


def supported_platform() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64", "aarch64")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _toolchain():
    """(compiler, mlx package dir, nanobind package dir), or raise NativeBuildError."""
    cxx = _compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler (install g++)")
    try:
        import nanobind
    except ImportError as e:
        raise NativeBuildError("nanobind is not installed (pip install 'nanobind>=3,<4')") from e
    if int(nanobind.__version__.split(".")[0]) != 3:
        raise NativeBuildError(f"nanobind {nanobind.__version__}: MLX's Python module needs nanobind 3.x")
    import mlx.core

    mlx_dir = Path(mlx.core.__file__).parent
    if not (mlx_dir / "include" / "mlx" / "mlx.h").exists():
        raise NativeBuildError(f"MLX headers not found under {mlx_dir / 'include'}")
    return cxx, mlx_dir, Path(nanobind.__file__).parent


def _cpu_flags() -> str:
    vendor, flags = cpu_features()
    return vendor + " " + " ".join(sorted(flags))


def _build_key(cxx: str, mlx_dir: Path, nb_dir: Path) -> str:
    import mlx.core
    import nanobind

    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cxx
    h = hashlib.sha256()
    for part in (_source().read_bytes().decode(), " ".join(_cxxflags()), mlx.core.__version__, str(mlx_dir),
                 nanobind.__version__, sysconfig.get_config_var("EXT_SUFFIX") or "", sys.version,
                 version, _cpu_flags()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = settings.native_dir()
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "parallm" / "native"


def build(force: bool = False) -> Path:
    """Compile the kernels if no build for this exact toolchain exists; return the module's path."""
    if not supported_platform():
        raise NativeBuildError(f"native kernels are built for Linux only (this is {sys.platform})")
    cxx, mlx_dir, nb_dir = _toolchain()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out_dir = cache_dir() / _build_key(cxx, mlx_dir, nb_dir)
    target = out_dir / (MODULE + suffix)
    if target.exists() and not force:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    includes = [sysconfig.get_paths()["include"], nb_dir / "include", nb_dir / "ext" / "robin_map" / "include",
                mlx_dir / "include"]
    lib_dir = mlx_dir / "lib"
    # Build next to the target and rename into place: concurrent builds never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out_dir)
    os.close(fd)
    cmd = [cxx, *_cxxflags(), *[f"-I{p}" for p in includes], str(_source()), str(nb_dir / "src" / "nb_combined.cpp"),
           f"-L{lib_dir}", "-lmlx", f"-Wl,-rpath,{lib_dir}", "-o", tmp]
    logger.info("building ParaLLM's native CPU kernels (once per toolchain) into %s", out_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"compiler failed to run: {e}") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"compilation failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


_unavailable: str | None = None  # why load() returned None


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (building it first if needed), or None where it is off or cannot be
    built (the reason is logged once and kept for :func:`status`)."""
    global _unavailable
    if not enabled_by_env():
        _unavailable = "off (PARALLM_NATIVE=0)"
        logger.info("native CPU kernels %s", _unavailable)
        return None
    if not supported_platform():
        _unavailable = f"not built on {sys.platform}/{platform.machine()}"
        return None
    try:
        path = build()
        import mlx.core  # noqa: F401  (MLX's module registers the array type first)

        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except NativeBuildError as e:
        _unavailable = str(e)
    except Exception as e:  # an ABI mismatch shows up as an import or type error
        _unavailable = f"failed to load: {e}"
    logger.warning("native CPU kernels unavailable, using the pure-MLX ones: %s", _unavailable)
    return None


def status() -> dict:
    """{"available": bool, "path" or "reason": str} (loads, and so builds, first)."""
    module = load()
    if module is None:
        return {"available": False, "reason": _unavailable or "unavailable"}
    return {"available": True, "path": module.__file__, "threads": module.threads()}
