"""Read a GGUF file: its header (metadata and tensor table) in pure Python, and its tensors as MLX arrays.

Tensors: ``mx.load`` reads F32 / F16 / Q4_0 / Q4_1 / Q8_0 natively (the quantized ones as MLX affine
(weight, scales, biases) triples with group size 32, which stay quantized). It cannot read any other
type, and reads BF16 as float16, so for those this module reads the raw blocks itself: BF16 exactly as
bfloat16; Q4_K (most of Ollama's default Q4_K_M files) and Q5_0 / Q5_1 (llama.cpp's fallback for rows not
a multiple of 256) re-packed as MLX affine 4- / 5-bit, group 32, which is the same arithmetic (and, in a
file mx.load cannot read, Q4_0 / Q4_1 / Q8_0 re-packed the way mx.load would); every other ggml type (Q2_K,
Q3_K, Q5_K, Q6_K, the IQ types) dequantized with the ``gguf`` package (ggml-org's own Python reference
code) to bfloat16.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod

from parallm_engine.errors import ModelLoadError

#: GGUF metadata value types (gguf spec) -> struct format; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
#: ggml tensor types ``mx.load`` turns into MLX arrays without loss (BF16 it reads, but as float16).
MX_NATIVE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
GGML_BF16 = 30


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first); GGUF stores the innermost dimension first
    ggml_type: int
    offset: int  # absolute, in the file


def read_gguf_header(gguf_path, want=lambda key: True, arrays: bool = False, tensors: bool = False):
    """``(metadata, tensor infos)`` of a GGUF file. Metadata keys ``want`` accepts; arrays only if ``arrays``
    (strings as lists of str, numbers as lists); the tensor table only if ``tensors``. Raises
    :class:`ModelLoadError` for a file that is not GGUF or is cut short."""
    with open(gguf_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(buf, gguf_path, want, arrays, tensors)
        except struct.error as exc:
            raise ModelLoadError(f"{gguf_path}: truncated or corrupt GGUF header ({exc})") from exc


def _parse(buf, path, want, arrays: bool, tensors: bool):
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file")
    version = struct.unpack_from("<I", buf, 4)[0]
    count_fmt = "<I" if version == 1 else "<Q"
    size = struct.calcsize(count_fmt)
    pos = 8
    (n_tensors,) = struct.unpack_from(count_fmt, buf, pos)
    (n_kv,) = struct.unpack_from(count_fmt, buf, pos + size)
    pos += 2 * size

    def string(pos):
        (n,) = struct.unpack_from(count_fmt, buf, pos)
        pos += size
        return bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

    def value(vtype, pos, keep):
        """(value or None when not kept, position after it)."""
        if vtype in _SCALARS:
            fmt = "<" + _SCALARS[vtype]
            return (struct.unpack_from(fmt, buf, pos)[0] if keep else None), pos + struct.calcsize(fmt)
        if vtype == 8:
            if keep:
                return string(pos)
            (n,) = struct.unpack_from(count_fmt, buf, pos)
            return None, pos + size + n
        if vtype == 9:
            etype, n = struct.unpack_from("<I" + count_fmt[1], buf, pos)
            pos += 4 + size
            keep = keep and arrays
            if etype in _SCALARS:
                width = struct.calcsize(_SCALARS[etype])
                items = list(struct.unpack_from(f"<{n}{_SCALARS[etype]}", buf, pos)) if keep else None
                return items, pos + n * width
            items = [] if keep else None
            for _ in range(n):
                item, pos = value(etype, pos, keep)
                if keep:
                    items.append(item)
            return items, pos
        raise ModelLoadError(f"{path}: unknown GGUF metadata type {vtype}")

    meta: dict = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        item, pos = value(vtype, pos + 4, want(key) or key == "general.alignment")
        if item is not None:
            meta[key] = item
    if not tensors:
        return meta, []
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(meta.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    return meta, [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]


def load_gguf_tensors(gguf_path, infos: list[TensorInfo]) -> dict:
    """Every tensor as MLX arrays (``name.weight`` / ``.scales`` / ``.biases`` for mx.load's quantized ones)."""
    import mlx.core as mx

    if all(t.ggml_type in MX_NATIVE_TYPES or t.ggml_type == GGML_BF16 for t in infos):
        try:
            weights = mx.load(str(gguf_path), format="gguf")  # Ollama blobs have no .gguf suffix
        except Exception as exc:  # mx.load raises plain ValueError/RuntimeError for bad files
            raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc
        exact = [t for t in infos if t.ggml_type == GGML_BF16]  # mx.load read these as float16
    else:  # mx.load cannot read this file at all: read every tensor here
        weights, exact = {}, infos
    if exact:
        with open(gguf_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for info in exact:
                repack = _REPACKED.get(info.ggml_type)
                if repack and info.name.endswith(".weight") and len(info.shape) == 2:
                    base = info.name[: -len(".weight")]
                    block, block_bytes, to_mlx = repack
                    raw = _raw_blocks(buf, info, block_bytes, block)
                    weights[info.name], weights[f"{base}.scales"], weights[f"{base}.biases"] = to_mlx(raw)
                else:
                    weights[info.name] = _read_tensor(buf, info, gguf_path)
    return weights


def _raw_blocks(buf, info: TensorInfo, block_bytes: int, block: int = 256):
    """The tensor's stored blocks, one row of the matrix per row (uint8)."""
    import numpy as np

    rows, cols = prod(info.shape[:-1]), info.shape[-1]
    count = rows * cols // block * block_bytes
    # a copy: a view would keep the mmap from closing
    return np.frombuffer(buf, dtype=np.uint8, count=count, offset=info.offset).reshape(rows, -1).copy()


def _read_tensor(buf, info: TensorInfo, path):
    import mlx.core as mx
    import numpy as np

    count = prod(info.shape)
    if info.ggml_type in (0, 1, GGML_BF16):
        dtype = {0: np.float32, 1: np.float16, GGML_BF16: np.uint16}[info.ggml_type]
        raw = np.frombuffer(buf, dtype=dtype, count=count, offset=info.offset).reshape(info.shape)
        arr = mx.array(raw.copy())
        return arr.view(mx.bfloat16) if info.ggml_type == GGML_BF16 else arr
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} has {info.name} in ggml type {info.ggml_type}, which needs the `gguf` package "
            "(pip install gguf) to read"
        ) from exc
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = prod(info.shape[:-1]), info.shape[-1]
        raw = np.frombuffer(buf, dtype=np.uint8, count=count // block * block_bytes, offset=info.offset)
        values = dequantize(raw.reshape(rows, cols // block * block_bytes), qtype)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: cannot read tensor {info.name} (ggml type {info.ggml_type}): {exc}") from exc
    # bfloat16: float16's range overflows on some families' weights (as mlx-community checkpoints use)
    return mx.array(values.reshape(info.shape)).astype(mx.bfloat16)


def pack_mlx(q, bits: int):
    """Unsigned ``bits``-wide integers (rows x cols) packed as MLX stores them: one little-endian bit stream
    per row, in uint32 words (for 4 bits: value k of a word at bits 4k)."""
    import numpy as np

    rows = q.shape[0]
    stream = (q.astype(np.uint32)[..., None] >> np.arange(bits, dtype=np.uint32)) & np.uint32(1)
    packed = np.packbits(stream.astype(np.uint8).reshape(rows, -1), axis=-1, bitorder="little")
    return packed.view("<u4").reshape(rows, -1)


def _as_mlx(q, scales, biases, bits: int):
    import mlx.core as mx

    rows = q.shape[0]
    return (mx.array(pack_mlx(q.reshape(rows, -1), bits)), mx.array(scales.reshape(rows, -1)).astype(mx.float16),
            mx.array(biases.reshape(rows, -1)).astype(mx.float16))


def q4_k_to_mlx(raw):
    """Q4_K rows -> MLX affine 4-bit, group 32 ``(packed uint32, scales, biases)``, kept quantized.

    A Q4_K super-block is 256 values in 8 groups of 32, value = d * sc_j * q - dmin * m_j (6-bit sc_j, m_j,
    4-bit q): per group exactly MLX's ``scale * q + bias``. Scales and biases are rounded to float16 once
    (as mx.load does for Q4_0 / Q4_1)."""
    import numpy as np
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    # 4 chunks of 32 bytes: low nibbles are values 0..31 of the chunk's 64, high nibbles values 32..63
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(rows, -1)
    return _as_mlx(q, d * sc.astype(np.float32), -dmin * m.astype(np.float32), 4)


def q5_to_mlx(raw, with_min: bool):
    """Q5_0 (value = d * (q - 16)) / Q5_1 (value = d * q + m) rows -> MLX affine 5-bit, group 32: the same
    values exactly (the fp16 d, m and -16 d are MLX's float16 scales and biases)."""
    import numpy as np

    rows = raw.shape[0]
    blocks = raw.reshape(-1, 24 if with_min else 22)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    bias = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if with_min else -16 * d
    rest = blocks[:, 4:] if with_min else blocks[:, 2:]
    qh = rest[:, :4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)  # bit j: the 5th bit of value j
    ql = rest[:, 4:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)  # values 0-15, 16-31
    q = (ql & np.uint8(0x0F)).reshape(-1, 32) | ((qh & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    return _as_mlx(q.reshape(rows, -1), d, bias, 5)


def legacy_to_mlx(raw, bits: int, with_min: bool):
    """Q8_0 (d * q, int8 q), Q4_0 (d * (q - 8)), Q4_1 (d * q + m) rows -> MLX affine, group 32, the same values:
    what mx.load does, for files it cannot read because of other tensors' types."""
    import numpy as np

    rows = raw.shape[0]
    head = 4 if with_min else 2
    blocks = raw.reshape(-1, head + 32 * bits // 8)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if bits == 8:
        q = (blocks[:, head:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _as_mlx(q.reshape(rows, -1), d, -128 * d, 8)
    bias = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if with_min else -8 * d
    ql = blocks[:, head:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    return _as_mlx((ql & np.uint8(0x0F)).reshape(rows, -1), d, bias, 4)


#: ggml types re-packed as MLX affine quantization (same values): type -> (block, block bytes, converter).
_REPACKED = {
    2: (32, 18, lambda raw: legacy_to_mlx(raw, 4, with_min=False)),  # Q4_0
    3: (32, 20, lambda raw: legacy_to_mlx(raw, 4, with_min=True)),  # Q4_1
    8: (32, 34, lambda raw: legacy_to_mlx(raw, 8, with_min=False)),  # Q8_0
    6: (32, 22, lambda raw: q5_to_mlx(raw, with_min=False)),  # Q5_0
    7: (32, 24, lambda raw: q5_to_mlx(raw, with_min=True)),  # Q5_1
    12: (256, 144, q4_k_to_mlx),  # Q4_K
}
