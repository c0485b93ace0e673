"""Which MLX backend library is installed and loaded (plain Python: never imports MLX).

On Linux the ``mlx`` wheel carries no backend: ``mlx-cpu``, ``mlx-cuda-12`` and ``mlx-cuda-13`` each install
the same file, ``mlx/lib/libmlx.so``. With two of them installed the process loads whichever pip wrote last,
silently; with none, ``import mlx.core`` fails with a bare linker error. So the backend is an explicit extra
(``parallm-engine[cpu]`` / ``[cuda12]`` / ``[cuda13]``), and this module names what is there, which one owns
the file on disk (by the sha256 each wheel's RECORD gives it) and what to do about a missing or mixed install.
On macOS ``mlx-metal`` comes with ``mlx`` itself.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata as metadata
import importlib.util
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parallm_engine.errors import ModelLoadError

#: Distributions that provide ``libmlx``, and the pip extra that installs each.
BACKEND_DISTS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda12", "mlx-cuda-13": "cuda13", "mlx-metal": "metal"}
LIBRARY = "mlx/lib/libmlx.so"


class MLXBackendMissingError(ModelLoadError):
    """No MLX backend library is installed (Linux: none of mlx-cpu / mlx-cuda-12 / mlx-cuda-13)."""


@dataclass
class MLXInstall:
    installed: dict[str, str] = field(default_factory=dict)  # dist name -> version
    owner: str | None = None  # the dist whose RECORD matches the library on disk
    problem: str | None = None  # what is wrong and how to fix it; None when the install is sound

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        names = ", ".join(f"{n} {v}" for n, v in sorted(self.installed.items())) or "none"
        owner = f"; libmlx from {self.owner}" if self.owner else ""
        return f"{names}{owner}"


def _record_hash(dist: metadata.Distribution, relpath: str) -> str | None:
    for entry in dist.files or ():
        if str(entry).replace("\\", "/") == relpath and entry.hash is not None:
            return entry.hash.value
    return None


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _library_path() -> Path | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    # ``mlx`` is a namespace package: any directory named mlx on sys.path (even the cwd's) is one of its parts.
    for part in spec.submodule_search_locations:
        path = Path(part) / "lib" / "libmlx.so"
        if path.is_file():
            return path
    return None


def inspect_install(hash_library: bool = True) -> MLXInstall:
    """The backend distributions installed, the one that owns ``libmlx.so`` (hashing it when more than one
    could: ~0.2 s), and the problem with the install, if any."""
    info = MLXInstall()
    for name in BACKEND_DISTS:
        try:
            info.installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if platform.system() != "Linux":
        return info
    library = _library_path()
    candidates = [n for n in info.installed if n != "mlx-metal"]
    if len(candidates) == 1:
        info.owner = candidates[0]
    elif len(candidates) > 1 and library is not None and hash_library:
        on_disk = _file_hash(library)
        info.owner = next((n for n in candidates
                           if _record_hash(metadata.distribution(n), LIBRARY) == on_disk), None)
    if not candidates or library is None:
        info.problem = (
            "no MLX backend library is installed. Install one explicitly: "
            "`pip install 'parallm-engine[cpu]'` (any Linux machine), `'parallm-engine[cuda13]'` (CUDA 13 GPUs) "
            "or `'parallm-engine[cuda12]'` (CUDA 12)."
        )
    elif len(candidates) > 1:
        keep = info.owner or candidates[-1]
        drop = " ".join(n for n in candidates if n != keep)
        info.problem = (
            f"several MLX backends are installed ({', '.join(candidates)}); they overwrite the same "
            f"{LIBRARY}, which now comes from {info.owner or 'none of them (modified)'}. "
            f"Keep one: `pip uninstall -y {drop}`, then `pip install --force-reinstall {keep}`."
        )
    return info


@functools.lru_cache(maxsize=1)
def require_backend_library() -> None:
    """Raise :class:`MLXBackendMissingError` before ``import mlx.core`` can fail with a linker error.

    A mixed install is not fatal here (one of the libraries is loaded and works); ``parallm info`` shows it.
    """
    if platform.system() != "Linux":
        return
    info = inspect_install(hash_library=False)
    if not [n for n in info.installed if n != "mlx-metal"] or _library_path() is None:
        raise MLXBackendMissingError(f"MLX cannot run here: {info.problem}")
