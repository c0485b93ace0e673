"""Which MLX backend library is installed (parallm_engine/models/mlx_install.py), on real dist-info layouts.

Each case writes an ``mlx`` package and backend wheels' dist-info (METADATA + RECORD with the sha256 pip
records) into a directory and inspects it in a Python started without site-packages, so only those
distributions exist for importlib.metadata."""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "engine"

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="the backend extras matter on Linux only")

PROBE = """
import json
from parallm_engine.errors import ParaLLMError
from parallm_engine.models.mlx_install import MLXBackendMissingError, inspect_install, require_backend_library
info = inspect_install()
try:
    require_backend_library()
    missing = None
except MLXBackendMissingError as exc:
    missing = str(exc)
print(json.dumps({"info": info.as_dict(), "missing": missing}))
"""


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_dist(site: Path, name: str, library: bytes) -> None:
    info = site / f"{name.replace('-', '_')}-0.32.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.32.4\n")
    (info / "RECORD").write_text(f"mlx/lib/libmlx.so,{_record_hash(library)},{len(library)}\n")


def _probe(site: Path) -> dict:
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{site}:{ENGINE}", "PARALLM_BLAS": "none"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _site(tmp_path: Path, on_disk: bytes | None) -> Path:
    site = tmp_path / "site"
    (site / "mlx").mkdir(parents=True)
    (site / "mlx" / "__init__.py").write_text("")
    if on_disk is not None:
        (site / "mlx" / "lib").mkdir()
        (site / "mlx" / "lib" / "libmlx.so").write_bytes(on_disk)
    return site


def test_one_backend_is_sound(tmp_path):
    site = _site(tmp_path, b"cpu library")
    _write_dist(site, "mlx-cpu", b"cpu library")
    out = _probe(site)
    assert out["info"]["installed"] == {"mlx-cpu": "0.32.4"}
    assert out["info"]["owner"] == "mlx-cpu" and out["info"]["problem"] is None
    assert out["missing"] is None


def test_two_backends_name_the_one_pip_wrote_last(tmp_path):
    site = _site(tmp_path, b"cuda library")
    _write_dist(site, "mlx-cpu", b"cpu library")
    _write_dist(site, "mlx-cuda-13", b"cuda library")
    out = _probe(site)
    assert out["info"]["owner"] == "mlx-cuda-13"
    assert "several MLX backends" in out["info"]["problem"] and "pip uninstall -y mlx-cpu" in out["info"]["problem"]
    assert out["missing"] is None  # one library is loaded and works: a warning, not an error


def test_no_backend_is_a_typed_error_naming_the_extras(tmp_path):
    site = _site(tmp_path, None)
    out = _probe(site)
    assert out["info"]["installed"] == {}
    assert out["missing"] and "parallm-engine[cpu]" in out["missing"] and "[cuda13]" in out["missing"]


def test_this_environment_is_sound():
    from parallm_engine.models.mlx_install import inspect_install

    info = inspect_install()
    assert info.problem is None and info.owner in ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
