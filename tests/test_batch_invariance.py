"""Batch-invariant matmuls (``runner/batch_invariance.py``): with the padding the probe chose, a row's bits
out of any product equal its bits inside a large one, under this process's BLAS and, in subprocesses, under
every other CPU BLAS this machine has (OpenBLAS, MKL, MLX's bundled reference BLAS); where no padding gives
that, the engine says so instead of claiming it. The engine-level invariants this serves (batched == alone,
a cache hit == a cold run, 8 / 4-bit KV) are in test_kv_quant.py, test_engine.py and test_model_zoo.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from hypothesis import given, settings, strategies as st

from parallm_engine.runner import backend, batch_invariance as bi

# The default model's projections and head, a tiny test model's, and a 1.7B-class model's.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (64, 64), (64, 16), (2048, 8192)]


def _rows_equal_large_product(k: int, n: int, m: int, off: int) -> bool:
    r = bi.min_rows(k, n)
    w = mx.random.normal((n, k), key=mx.random.key(n)) / k ** 0.5
    x = mx.random.normal((off + m + 160, k), key=mx.random.key(k + m))
    large = x @ w.T
    alone = bi.padded_matmul(x[off:off + m], lambda a: a @ w.T, r or 1)
    return bool(mx.array_equal(alone, large[off:off + m]).item())


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from(SHAPES), m=st.integers(1, 70), off=st.integers(0, 9))
def test_padded_rows_equal_rows_of_a_large_product(shape, m, off):
    """Where the probe found a padding, every row count gives the large product's bits for its rows."""
    k, n = shape
    if bi.min_rows(k, n) is None:
        pytest.skip(f"this BLAS ({backend.backend_info().blas}) is not row-invariant for {shape}")
    assert _rows_equal_large_product(k, n, m, off)


def test_padding_keeps_shape_and_values():
    w = mx.random.normal((48, 32))
    b = mx.random.normal((48,))
    x = mx.random.normal((2, 1, 32))
    y = bi.padded_matmul(x, lambda a: mx.addmm(b, a, w.T), 8)
    assert y.shape == (2, 1, 48)
    assert mx.allclose(y, mx.addmm(b, x, w.T), atol=1e-5).item()
    assert bi.padded_matmul(mx.zeros((0, 32)), lambda a: a @ w.T, 8).shape == (0, 48)


def test_install_switches_only_plain_float32_modules():
    """Per instance: another model's (or mlx's own) nn.Linear is untouched; float16 weights (a GPU's) keep
    theirs; bfloat16 weights, widened to a float32 sgemm by MLX, are padded as float32 ones."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.kv = nn.Linear(576, 192, bias=False)
            self.half = nn.Linear(576, 192, bias=False)
            self.half.weight = self.half.weight.astype(mx.float16)
            self.bf16 = nn.Linear(576, 192, bias=False)
            self.bf16.weight = self.bf16.weight.astype(mx.bfloat16)

    net, other = Net(), nn.Linear(576, 192, bias=False)
    done = bi.install(net)
    r = bi.min_rows(576, 192)
    if r is None:
        assert not done.holds and (576, 192) in done.variant and "off" in done.describe()
        assert type(net.kv) is nn.Linear
    elif r > 1:
        assert type(net.kv) is bi._RowPaddedLinear and net.kv.padded_rows == r
        assert type(net.bf16) is bi._RowPaddedLinear
        assert done.padded[(576, 192)] == r and done.describe().startswith("on")
    assert type(net.half) is nn.Linear and type(other) is nn.Linear
    x = mx.random.normal((1, 576))
    assert mx.allclose(net.kv(x), x @ net.kv.weight.T, atol=1e-5).item()


def test_engine_reports_it(engine):
    """The engine's backend line and ``parallm info`` say whether rows are batch-invariant here."""
    line = engine.backend.batch_invariance
    assert line.startswith("on") or line.startswith("off")
    verdict = bi.blas_verdict()
    assert verdict.describe().startswith("on" if verdict.holds else "off")


_PROBE = """
import json, sys
import parallm_engine
from parallm_engine.runner import backend, batch_invariance as bi
import mlx.core as mx
out = {"blas": backend.backend_info().blas, "shapes": {}}
for k, n in [(576, 576), (576, 192), (1536, 576), (64, 64)]:
    r = bi.min_rows(k, n)
    ok = True
    if r is not None:
        w = mx.random.normal((n, k)); x = mx.random.normal((200, k)); large = x @ w.T
        for m in (1, 2, 3, 5, 6, 7, 9, 13, 31, 64):
            for off in (0, 3):
                y = bi.padded_matmul(x[off:off + m], lambda a: a @ w.T, r)
                ok = ok and bool(mx.array_equal(y, large[off:off + m]).item())
    out["shapes"][f"{k}x{n}"] = {"rows": r, "equal": ok}
print(json.dumps(out))
"""


def _blas_libraries() -> list[str]:
    found = [p for p in backend._OPENBLAS_CANDIDATES if os.path.exists(p)][:1]
    found += backend._mkl_candidates()[:1]
    return found + ["none"]


@pytest.mark.parametrize("blas", _blas_libraries())
def test_every_blas_here(blas):
    """Each CPU BLAS on this machine, forced with PARALLM_BLAS: the padding the probe picks gives the large
    product's bits for every row count; MLX's reference BLAS (naive loops) needs none."""
    env = dict(os.environ, PARALLM_BLAS=blas)
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert (blas == "none") == got["blas"].startswith("reference"), got
    for shape, verdict in got["shapes"].items():
        assert verdict["equal"], (blas, shape, verdict)
        if blas == "none":
            assert verdict["rows"] == 1, (shape, verdict)
