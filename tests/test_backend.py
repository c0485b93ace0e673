"""Choosing the CBLAS and its settings for this CPU (parallm_engine.runner.backend), before MLX loads it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from parallm_engine.runner import backend

AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a given CPU: cpu("AuthenticAMD", flags)."""

    def fake(vendor: str, flags: set[str]):
        monkeypatch.setattr(backend, "cpu_features", lambda: (vendor, set(flags)))

    return fake


def test_cpu_features_reads_this_machine():
    vendor, flags = backend.cpu_features()
    if os.path.exists("/proc/cpuinfo"):
        assert isinstance(vendor, str) and flags, "flags should be read from /proc/cpuinfo"


def test_openblas_goes_first_on_amd_with_avx512(cpu, monkeypatch):
    monkeypatch.setattr(backend, "_mkl_candidates", lambda: ["/x/lib/libmkl_rt.so.3"])
    cpu("AuthenticAMD", AVX512)
    order = backend.blas_candidates()
    assert "openblas" in os.path.basename(order[0]) and order[-1].endswith("libmkl_rt.so.3")
    cpu("GenuineIntel", AVX512)
    assert backend.blas_candidates()[0].endswith("libmkl_rt.so.3")
    cpu("AuthenticAMD", {"avx2", "fma"})  # not measured without AVX-512: MKL keeps its place
    assert backend.blas_candidates()[0].endswith("libmkl_rt.so.3")


def test_openblas_core_type_applies_to_our_load_only(cpu, monkeypatch):
    cpu("AuthenticAMD", AVX512)
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # a machine-wide pin for numpy's OpenBLAS
    monkeypatch.delenv("PARALLM_OPENBLAS_CORETYPE", raising=False)
    restore = backend._configure_openblas()
    assert os.environ["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert restore == {"OPENBLAS_CORETYPE": "Haswell"}

    monkeypatch.setenv("PARALLM_OPENBLAS_CORETYPE", "inherit")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert backend._configure_openblas() == {}
    assert os.environ["OPENBLAS_CORETYPE"] == "Haswell"

    monkeypatch.setenv("PARALLM_OPENBLAS_CORETYPE", "Zen")
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    assert backend._configure_openblas() == {"OPENBLAS_CORETYPE": None}
    assert os.environ["OPENBLAS_CORETYPE"] == "Zen"


def test_no_avx512_leaves_the_core_type_alone(cpu, monkeypatch):
    cpu("AuthenticAMD", {"avx2", "fma"})
    monkeypatch.delenv("PARALLM_OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    assert backend._configure_openblas() == {}
    assert "OPENBLAS_CORETYPE" not in os.environ


def test_preload_restores_the_environment_after_loading(cpu, monkeypatch, tmp_path):
    """The core type is set while the library loads (it reads it then) and put back afterwards."""
    cpu("AuthenticAMD", AVX512)
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"")
    seen = {}

    def fake_cdll(path, mode=0):
        seen["core"] = os.environ.get("OPENBLAS_CORETYPE")
        return object()

    monkeypatch.setattr(backend.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(backend, "_preload_done", False)
    monkeypatch.setattr(backend, "_preloaded", None)
    monkeypatch.setattr(backend, "_preload_too_late", False)
    # As at the package's first import. Never by taking mlx.core out of sys.modules: an engine thread
    # still alive in this process would import it again, and nanobind aborts the process.
    monkeypatch.setattr(backend, "_mlx_imported", lambda: False)
    monkeypatch.setenv("PARALLM_BLAS", str(fake))
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.delenv("PARALLM_OPENBLAS_CORETYPE", raising=False)
    assert backend.preload_blas() == str(fake)
    assert seen["core"] == "SkylakeX"
    assert os.environ["OPENBLAS_CORETYPE"] == "Haswell"


def test_blas_threads_follow_the_lanes(monkeypatch):
    monkeypatch.delenv("PARALLM_DECODE_LANES", raising=False)
    monkeypatch.setattr(backend, "_preloaded", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    assert backend.cpu_lanes() == 1  # OpenBLAS threads use the cores inside each GEMM
    monkeypatch.setattr(backend, "_preloaded", "/x/lib/libmkl_rt.so.3")
    monkeypatch.setattr(backend, "usable_cores", lambda: 2)
    assert backend.cpu_lanes() == 2  # MKL runs sequential inside one lane per core
    monkeypatch.setenv("PARALLM_DECODE_LANES", "3")
    assert backend.cpu_lanes() == 3


def test_mkl_leaves_a_core_to_the_host(monkeypatch):
    """An MKL OpenMP team that takes every core fights the engine thread for them (one lane forced on 2
    cores: decode 3x slower than sequential MKL), so a lane gets the cores but one, shared by the lanes."""
    assert backend.mkl_threads_per_lane(2, 1) == 1
    assert backend.mkl_threads_per_lane(2, 2) == 1
    assert backend.mkl_threads_per_lane(8, 4) == 1
    assert backend.mkl_threads_per_lane(16, 4) == 3
    assert backend.mkl_threads_per_lane(16, 1) == 15
    monkeypatch.setattr(backend, "usable_cores", lambda: 2)
    monkeypatch.setenv("PARALLM_DECODE_LANES", "1")
    monkeypatch.delenv("MKL_THREADING_LAYER", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    backend._configure_mkl()
    assert os.environ["MKL_THREADING_LAYER"] == "SEQUENTIAL"
    monkeypatch.setenv("MKL_THREADING_LAYER", "GNU")  # the user's setting wins
    backend._configure_mkl()
    assert os.environ["MKL_THREADING_LAYER"] == "GNU"


def test_info_says_how_the_blas_threads(monkeypatch):
    monkeypatch.setenv("MKL_THREADING_LAYER", "SEQUENTIAL")
    assert backend.blas_threading("/x/lib/libmkl_rt.so.3") == "MKL sequential: one thread per decode lane"
    monkeypatch.setenv("MKL_THREADING_LAYER", "GNU")
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert backend.blas_threading("/x/lib/libmkl_rt.so.3") == "MKL GNU threading, 3 thread(s) per call"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    path = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert backend.blas_threading(path) == "OpenBLAS, 2 thread(s) per call"
    assert backend.blas_threading("") == ""


def test_forced_lanes_share_the_openblas_threads(cpu, monkeypatch):
    cpu("AuthenticAMD", AVX512)
    monkeypatch.setattr(backend, "usable_cores", lambda: 4)
    monkeypatch.setenv("PARALLM_DECODE_LANES", "2")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    backend._configure_openblas()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2"


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is Linux-only")
def test_importing_mlx_first_is_reported_not_hidden():
    """mlx.core imported before parallm_engine binds MLX's reference BLAS: the backend says so and
    the engine's warning says how to fix the import order (a preload then would do nothing)."""
    code = (
        "import logging, mlx.core, parallm_engine\n"
        "from parallm_engine.runner import backend\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "info = backend.backend_info()\n"
        "print('BLAS=' + info.blas)\n"
        "backend.warn_if_slow_blas(info)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BLAS=reference (mlx imported first)" in out.stdout, out.stderr
    assert "Import parallm_engine (or parallm_integrations) before mlx" in out.stderr


def test_backend_object_reads_each_devices_memory_with_the_queries_faked():
    """The memory budget comes from the device: Metal's recommended working set, CUDA's device memory,
    RAM on the CPU; a missing or failing query falls back to RAM."""
    from types import SimpleNamespace

    from parallm_engine.runner.backend import device_memory

    metal = SimpleNamespace(device_info=lambda: {"max_recommended_working_set_size": 48 << 30, "memory_size": 64 << 30})
    assert device_memory("gpu", metal) == (48 << 30, "metal working set")
    cuda = SimpleNamespace(device_info=lambda: {"total_memory": 80 << 30})
    assert device_memory("cuda", cuda) == (80 << 30, "cuda device memory")

    def broken():
        raise RuntimeError("no device")

    ram, source = device_memory("gpu", SimpleNamespace(device_info=broken))
    assert source == "system RAM" and ram > 0
    assert device_memory("cpu", metal)[1] == "system RAM"


def test_backend_choice_and_overrides(monkeypatch):
    from parallm_engine.runner.backend import choose_backend

    assert choose_backend("cpu-mlx").cpu_kernels is False
    monkeypatch.setenv("PARALLM_CPU_KERNELS", "0")
    assert choose_backend().name == "cpu-mlx"
    monkeypatch.delenv("PARALLM_CPU_KERNELS")
    monkeypatch.setenv("PARALLM_BACKEND", "cpu-mlx")
    b = choose_backend()
    assert b.name == "cpu-mlx" and "MLX ops" in b.attention
    assert b.kv_budget() == max(256 << 20, b.memory_bytes // 4)
    with pytest.raises(ValueError, match="not available"):
        choose_backend("metal")
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("tpu")
