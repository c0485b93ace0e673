"""KV-cache quantization: keys and values stored at 8 or 4 bits, read back as floats.

The format is mlx-lm's ``QuantizedKVCache``: ``mx.quantize`` along the head dimension (groups of
``group_size`` values with a scale and a bias each), so every (token, head) is quantized on its own.
That makes quantization a pure function of the token's own K/V: the same token quantizes to the same
bits whether it was prefilled alone, in a batch, in a chunk, or came from the radix tree, so every
engine invariant (batched == alone, cache hit == cold run, seeded runs independent of batch mates)
holds with quantization on exactly as with it off.

Where the KV rests (decode batch rows, sequences being prefilled, the radix tree, shared prefixes) it is
a :class:`QuantizedKV`, which stands in for a ``(B, H, T, D)`` float array in the handful of operations
``kv_cache`` does on stored KV (slicing the token axis, picking rows, slice assignment, padding,
concatenating, ``nbytes``). A cache's ``update_and_fetch`` quantizes the new keys and values on entry
and hands attention the dequantized floats (:func:`as_float`), so every attention path (the native CPU
kernels, the shared-prefix cascade, MLX's SDPA) reads exactly the values that are stored. The
dequantized working set is transient, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from parallm_engine import settings
from parallm_engine.errors import InvalidRequestError

SUPPORTED_BITS = (4, 8)
#: Why speculation is refused with quantized KV: it is exact only where the K/V of a position have the same
#: bits when verified in a block of positions as when decoded alone, and quantization turns a last-bit
#: difference into a whole rounding step, enough to change a later token.
NO_SPECULATION = ("speculative decoding is not supported with a quantized KV cache (kv_bits): verifying "
                  "several positions in one forward can round a key or value to a different quantization "
                  "step than decoding it alone, so the output would not be exactly the non-speculative one")
GROUP_SIZES = (64, 32)  # the largest that divides the head dimension is used


class KVQuantizationError(InvalidRequestError):
    """KV quantization asked for with settings or a model it cannot serve."""

    def __init__(self, message: str):
        super().__init__(message, param="kv_bits")


@dataclass(frozen=True)
class KVFormat:
    """How a model's KV is stored: ``bits`` per value in groups of ``group_size`` along the head
    dimension (``mx.quantize``'s affine mode: a float scale and bias per group)."""

    bits: int
    group_size: int


def resolve_kv_bits(kv_bits) -> int | None:
    """``kv_bits`` as given to ``Engine`` / ``--kv-bits`` (None: ``PARALLM_KV_BITS``): None, 0, 16 or 32
    mean unquantized; 8 or 4 quantize."""
    if kv_bits is None:
        kv_bits = settings.kv_bits()
    if kv_bits is None:
        return None
    if isinstance(kv_bits, bool):
        raise KVQuantizationError(f"kv_bits must be 4 or 8 (or None), got {kv_bits!r}")
    try:
        bits = int(kv_bits)
    except (TypeError, ValueError):
        raise KVQuantizationError(f"kv_bits must be 4 or 8 (or None), got {kv_bits!r}") from None
    if bits in (0, 16, 32):
        return None
    if bits not in SUPPORTED_BITS:
        raise KVQuantizationError(f"kv_bits must be 4 or 8 (or None), got {kv_bits!r}")
    return bits


def format_for_model(bits: int | None, model, n_layers: int, layout: str) -> KVFormat | None:
    """The storage format for ``model`` at ``bits`` (None: floats); a typed error when the model cannot
    be served quantized: its caches are mlx-lm's own (the "mixed" layout: sliding-window or recurrent
    layers), or a head dimension no group size divides."""
    if bits is None:
        return None
    if layout != "attention":
        raise KVQuantizationError(
            "KV quantization needs the engine's own KV storage; this model's sliding-window or recurrent "
            "layers use mlx-lm's cache classes (the 'mixed' layout): run it without kv_bits")
    dims = {d for probe in _probe(model, n_layers) for d in probe.dims}
    for gs in GROUP_SIZES:
        if all(d % gs == 0 for d in dims):
            return KVFormat(bits, gs)
    raise KVQuantizationError(f"KV quantization needs head dimensions divisible by 32, got {sorted(dims)}")


def bytes_per_token(model, n_layers: int, fmt: KVFormat) -> int:
    """Stored KV bytes one more token costs across every layer, in ``fmt`` (packed values, scales and
    biases), measured on the model's own K/V shapes and dtype."""
    total = 0
    for probe in _probe(model, n_layers):
        k, v = probe.kv
        total += quantize(k, fmt).nbytes + quantize(v, fmt).nbytes
    return total


class _ShapeProbe:
    """A cache that records the K/V one token produces (what a layer stores per token)."""

    offset = 0

    def __init__(self):
        self.kv = None

    @property
    def dims(self) -> tuple[int, int]:
        return self.kv[0].shape[-1], self.kv[1].shape[-1]

    def update_and_fetch(self, keys, values):
        self.kv = (keys, values)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return None


def _probe(model, n_layers: int) -> list[_ShapeProbe]:
    probes = [_ShapeProbe() for _ in range(n_layers)]
    model(mx.zeros((1, 1), dtype=mx.int32), cache=probes)
    done = [p for p in probes if p.kv is not None]
    mx.eval([a for p in done for a in p.kv])
    return done


class QuantizedKV:
    """A quantized stand-in for a ``(B, H, T, D)`` float array of keys or values.

    Indexing must leave the last axis whole (every index ``kv_cache`` uses does: ``[..., a:b, :]``,
    ``[i:i+1, :, a:b, :]``, ``[rows]``); it is applied to the packed values, the scales and the biases
    alike, which share every axis but the last."""

    __slots__ = ("packed", "scales", "biases", "fmt", "dims", "dtype")

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, fmt: KVFormat, dims: int, dtype):
        self.packed, self.scales, self.biases = packed, scales, biases
        self.fmt, self.dims, self.dtype = fmt, dims, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.dims)

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def _parts(self):
        return self.packed, self.scales, self.biases

    def _like(self, parts) -> "QuantizedKV":
        return QuantizedKV(*parts, self.fmt, self.dims, self.dtype)

    def __getitem__(self, index) -> "QuantizedKV":
        return self._like(tuple(p[index] for p in self._parts()))

    def __setitem__(self, index, value: "QuantizedKV") -> None:
        for p, v in zip(self._parts(), value._parts()):
            p[index] = v

    def dequantize(self) -> mx.array:
        f = self.fmt
        if self.packed.size == 0:  # MLX cannot dequantize an empty array
            return mx.zeros(self.shape, self.dtype)
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=f.group_size, bits=f.bits).astype(self.dtype)


def quantize(x: mx.array, fmt: KVFormat) -> QuantizedKV:
    if x.size == 0:  # MLX cannot quantize an empty array
        lead = tuple(x.shape[:-1])
        return QuantizedKV(mx.zeros((*lead, x.shape[-1] * fmt.bits // 32), mx.uint32),
                           mx.zeros((*lead, x.shape[-1] // fmt.group_size), x.dtype),
                           mx.zeros((*lead, x.shape[-1] // fmt.group_size), x.dtype), fmt, x.shape[-1], x.dtype)
    packed, scales, biases = mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits)
    return QuantizedKV(packed, scales, biases, fmt, x.shape[-1], x.dtype)


def store(x, fmt: KVFormat | None):
    """``x`` (fresh float K or V from the model) in the storage format."""
    if fmt is None or x is None or isinstance(x, QuantizedKV):
        return x
    return quantize(x, fmt)


def as_float(x):
    """What attention reads: the dequantized values of stored KV (floats pass through)."""
    return x.dequantize() if isinstance(x, QuantizedKV) else x


def zeros(shape: tuple[int, ...], like):
    """Zero-filled storage of logical ``shape`` in the kind of ``like`` (float or quantized)."""
    if not isinstance(like, QuantizedKV):
        return mx.zeros(shape, like.dtype)
    f = like.fmt
    lead, dims = tuple(shape[:-1]), shape[-1]
    return QuantizedKV(mx.zeros((*lead, dims * f.bits // 32), like.packed.dtype),
                       mx.zeros((*lead, dims // f.group_size), like.scales.dtype),
                       mx.zeros((*lead, dims // f.group_size), like.biases.dtype), f, dims, like.dtype)


def pad(x, widths):
    """``mx.pad`` along leading axes (the last axis is never padded)."""
    if not isinstance(x, QuantizedKV):
        return mx.pad(x, widths)
    assert tuple(widths[-1]) == (0, 0), "the head axis is never padded"
    return x._like(tuple(mx.pad(p, widths) for p in x._parts()))


def concatenate(parts: list, axis: int = 0):
    if not isinstance(parts[0], QuantizedKV):
        return mx.concatenate(parts, axis=axis)
    assert axis % 4 != 3, "the head axis is never concatenated"
    return parts[0]._like(tuple(mx.concatenate([q._parts()[j] for q in parts], axis=axis) for j in range(3)))


def contiguous(x):
    if not isinstance(x, QuantizedKV):
        return mx.contiguous(x)
    return x._like(tuple(mx.contiguous(p) for p in x._parts()))


def broadcast_rows(x, rows: int):
    """``x`` (1, H, T, D) seen as (rows, H, T, D) without a copy."""
    if not isinstance(x, QuantizedKV):
        return mx.broadcast_to(x, (rows, *x.shape[1:]))
    return x._like(tuple(mx.broadcast_to(p, (rows, *p.shape[1:])) for p in x._parts()))


def arrays(x) -> list[mx.array]:
    """The MLX arrays behind stored KV (for ``mx.eval``)."""
    if x is None:
        return []
    return list(x._parts()) if isinstance(x, QuantizedKV) else [x]
