"""Batch-invariant matmuls on the CPU: a row's result does not depend on the rows beside it.

The engine promises that a request's tokens do not depend on what shares its batch (batched == alone,
a cache hit == a cold run, a seed the same in any batch). On the CPU every float32 matmul of MLX is the
BLAS's ``sgemm``, and BLAS libraries choose their kernel by the product's shape: OpenBLAS runs products
with few rows through a separate "small matrix" kernel, MKL computes its first rows with an edge kernel
up to its tile height, and each sums a row's products in its own order. The same row then comes out of
a 1-row product (a decode step alone, or a prompt's last token recomputed on a cache hit) and out of a
40-row one (a batch, a cold prefill) with different last bits; greedy decoding usually hides that, but
quantized KV (``kv_quant``) can turn one bit into a different code and a different token.

Past those small-product kernels the libraries' main kernels compute each row the same way whatever
the row count (OpenBLAS's AVX-512 kernels, MKL on one thread, the reference BLAS). So a product with
fewer rows than that is padded with zero rows up to it: the row takes the same kernel as in any larger
batch. Where the threshold lies depends on the library, its version, the CPU and the shape, so it is
measured, not assumed: :func:`min_rows` tries paddings on each of the model's own weight shapes and
keeps the smallest under which every row of every tried product equals the same row in a large one.
Where no padding gives that (OpenBLAS's AVX2 kernels compute a row by its position in a tile at any row
count), the shape keeps its plain matmul and the engine reports that it is not batch-invariant
(``parallm info``, ``Engine.backend.batch_invariance``); ``docs/determinism.md`` states what holds there.

The padding is installed per model instance (the module's class is switched, as ``cpu_kernels`` does),
for plain ``nn.Linear`` modules and a tied output head (``nn.Embedding.as_linear``) with float32 or
bfloat16 weights (MLX widens those to a float32 ``sgemm``); the native kernels' own linear computes each
row alone and needs none.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger("parallm_engine")

#: Paddings tried, smallest first (1: the plain matmul).
CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: Rows of the reference product every probe is compared with.
_REFERENCE_ROWS = 160
#: A weight with more output features is probed on its first ones (kernels choose by these shapes
#: only up to well below this; probing a 150k-row vocabulary head would cost seconds).
_PROBE_FEATURES = 4096


def padded_matmul(x: mx.array, matmul, min_rows: int) -> mx.array:
    """``matmul(x)`` for ``x`` of shape (..., K), computed with at least ``min_rows`` rows (zero rows
    appended, their results dropped)."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if rows >= min_rows or rows == 0:
        return matmul(x)
    if x.ndim >= 2 and x.shape[-2] == rows:  # (1, ..., rows, K), a decode step's: pad in place, no reshapes
        widths = [(0, 0)] * x.ndim
        widths[-2] = (0, min_rows - rows)
        return matmul(mx.pad(x, widths))[..., :rows, :]
    flat = mx.pad(x.reshape(rows, k), [(0, min_rows - rows), (0, 0)])
    y = matmul(flat)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


#: Row counts probed without padding: each candidate, just past it, twice it, and a few larger.
_PROBE_ROWS = sorted({m for r in CANDIDATE_ROWS for m in (r, r + 1, r + 3, 2 * r + 1)} | {37, 150})


def _rows_match(matmul, x: mx.array, reference: mx.array, m: int, r: int = 1) -> bool:
    """Whether ``m`` rows (padded to ``r``) come out with the reference product's bits for those rows, at a
    tile-aligned offset (0) and a misaligned one (5)."""
    for off in ((0, 5) if m < 16 else (5,)):
        if off + m > x.shape[0]:
            continue
        y = padded_matmul(x[off:off + m], matmul, r)
        if not mx.array_equal(y, reference[off:off + m]).item():
            return False
    return True


@functools.lru_cache(maxsize=256)
def _min_rows_for_shape(k: int, n: int, bias: bool, dtype: str, blas: str) -> int | None:
    """The smallest padding under which ``x @ W.T (+ b)`` of this shape is row-invariant (probed with
    random data: which kernel runs depends on the shapes, not the values); None if none is.
    ``blas`` is part of the key only: a process has one BLAS."""
    key = mx.random.key(k * 1_000_003 + n)
    kw, kx, kb = mx.random.split(key, 3)
    dt = getattr(mx, dtype)
    w = (mx.random.normal((n, k), key=kw) / (k ** 0.5)).astype(dt)
    b = mx.random.normal((n,), key=kb).astype(dt) if bias else None
    x = mx.random.normal((_REFERENCE_ROWS, k), key=kx).astype(dt)

    def matmul(a):
        return a @ w.T if b is None else mx.addmm(b, a, w.T)

    reference = matmul(x)
    mx.eval(reference)
    # A padding r works when every product of r rows or more is row-invariant (the kernel then chosen for
    # r rows is the large products'); the smaller ones, padded to r, are checked again to be sure.
    bad = [m for m in _PROBE_ROWS if m <= _REFERENCE_ROWS - 5 and not _rows_match(matmul, x, reference, m)]
    for r in CANDIDATE_ROWS:
        if all(m < r for m in bad) and all(_rows_match(matmul, x, reference, m, r) for m in range(1, r)):
            return r
    return None


def min_rows(k: int, n: int, bias: bool = False, dtype=mx.float32) -> int | None:
    """:func:`_min_rows_for_shape` for a weight of ``n`` output and ``k`` input features."""
    from parallm_engine.runner import backend

    return _min_rows_for_shape(int(k), min(int(n), _PROBE_FEATURES), bool(bias), str(dtype).split(".")[-1],
                               backend.backend_info().blas)


class _RowPaddedLinear(nn.Linear):
    """A model's ``nn.Linear`` with its class switched: products of fewer than ``padded_rows`` rows padded."""

    def __call__(self, x: mx.array) -> mx.array:
        return padded_matmul(x, super().__call__, self.padded_rows)


class _RowPaddedEmbedding(nn.Embedding):
    """A model's ``nn.Embedding`` with its class switched: the tied output head's products padded."""

    def as_linear(self, x: mx.array) -> mx.array:
        return padded_matmul(x, super().as_linear, self.padded_rows)


@dataclass
class BatchInvariance:
    """What :func:`install` did to a model: modules padded, and the shapes no padding makes invariant."""

    padded: dict[tuple[int, int], int] = field(default_factory=dict)  # (K, N) -> rows, for padded shapes
    variant: list[tuple[int, int]] = field(default_factory=list)  # shapes whose rows stay batch-dependent

    @property
    def holds(self) -> bool:
        return not self.variant

    def record(self, k: int, n: int, rows: int | None) -> None:
        """A (K, N) weight shape's probe result (:func:`min_rows`): batch-dependent, padded, or neither."""
        if rows is None:
            if (k, n) not in self.variant:
                self.variant.append((k, n))
        elif rows > 1:
            self.padded[(k, n)] = rows

    def describe(self) -> str:
        if self.variant:
            return (f"off: the BLAS's rows depend on the batch for {len(self.variant)} weight shape(s) at every "
                    f"padding tried (e.g. {self.variant[0][1]}x{self.variant[0][0]}); tokens equal up to near-ties")
        if self.padded:
            rows = sorted(set(self.padded.values()))
            return f"on: products of fewer rows padded to {'/'.join(map(str, rows))} for {len(self.padded)} weight shape(s)"
        return "on: the BLAS's rows are batch-invariant as they are"


def install(model) -> BatchInvariance:
    """Switch ``model``'s plain ``nn.Linear`` / ``nn.Embedding`` modules whose small products
    are not row-invariant on this BLAS to their padded classes (per instance: nothing process-wide)."""
    done = BatchInvariance()
    if not isinstance(model, nn.Module):
        return done
    for _, module in model.named_modules():
        cls = type(module)
        if cls not in (nn.Linear, nn.Embedding) or module.weight.dtype not in (mx.float32, mx.bfloat16):
            continue
        n, k = module.weight.shape
        bias = cls is nn.Linear and "bias" in module
        r = min_rows(k, n, bias)
        done.record(k, n, r)
        if r is not None and r > 1:
            module.padded_rows = r
            module.__class__ = _RowPaddedLinear if cls is nn.Linear else _RowPaddedEmbedding
    if done.variant:
        logger.info("batch invariance %s", done.describe())
    return done


@functools.lru_cache(maxsize=1)
def blas_verdict() -> BatchInvariance:
    """This BLAS on a few common weight shapes (random weights), for ``parallm info``."""
    done = BatchInvariance()
    for k, n in ((576, 576), (576, 192), (576, 1536), (1536, 576), (2048, 2048), (2048, 512), (2048, 8192)):
        done.record(k, n, min_rows(k, n))
    return done
