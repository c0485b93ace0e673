"""The CPU backend's weight storage: float32 (the default) or bfloat16 (``weights_dtype="bfloat16"``).

bfloat16 keeps each Linear / Embedding weight in half the memory, so a decode step, which streams
every weight once, reads half the bytes. Only the storage changes: activations, norms, biases and the
KV cache stay float32, and every matmul widens the weights to float32 exactly (bf16 -> fp32 is a
16-bit shift) with float32 accumulation:

- native kernels (``cpu-native``): the decode linear widens them in registers (``kernels.cpp``); a
  prefill's many rows widen a block of weight rows at a time into a scratch buffer (in cache) for the BLAS
  (``gemm_split``), much faster than MLX's bfloat16 matmul on the CPU (docs/benchmarks-archive.md, "bf16 on
  CPU: `weights_dtype="bfloat16"`").
- pure MLX (``cpu-mlx``): MLX promotes ``float32 @ bfloat16`` to float32 (a widened copy of the weight
  per call): slower, the same math.

The only error against float32 is the weights' rounding to bfloat16 (8 bits of mantissa);
``tests/test_bf16.py`` bounds its effect on the default model's logprobs. Metal and CUDA keep the
checkpoint's own dtype (their matmuls read half precision natively); the option applies to the CPU.

``weights_dtype="bfloat16-matmul"`` also rounds each matmul's input (the activations entering every
Linear and the tied output head) to bfloat16 (nearest even); products of two bfloat16 values are exact
in float32 and the sums stay float32. That is the math of AVX512_BF16's ``vdpbf16ps`` (32
multiply-adds per instruction against float32 FMA's 16): where the native kernels are built for it
(``linear_bf16_packed`` in ``kernels.cpp``, on the weights packed into panels at their first use) every
row count runs through it, decode and prefill; elsewhere
(pure MLX, or a CPU without AVX512_BF16) the same math in MLX ops (the input rounded to bfloat16 and
back, then the float32 matmul), slower than ``"bfloat16"``. The error against float32 is the weights'
and the inputs' rounding; ``tests/test_bf16.py`` bounds it.
"""

from __future__ import annotations

import functools
import logging

from parallm_engine import settings
from parallm_engine.runner.bf16_embedding import bf16_embedding_class
from parallm_engine.errors import InvalidRequestError

logger = logging.getLogger("parallm_engine")

#: The modes that store weights as bfloat16 (the second also rounds matmul inputs).
BF16_WEIGHTS = ("bfloat16", "bfloat16-matmul")
WEIGHTS_DTYPES = ("float32", *BF16_WEIGHTS)


def resolve_weights_dtype(value: str | None, device: str) -> str | None:
    """The weight dtype a new engine uses on ``device``: ``value`` (or ``PARALLM_WEIGHTS_DTYPE``), default
    float32 on the CPU; None (the checkpoint's own dtype) on Metal and CUDA."""
    given = value if value is not None else settings.weights_dtype()
    chosen = None
    if given is not None:
        chosen = str(given).lower()
        chosen = {"bf16": "bfloat16", "fp32": "float32", "bf16-matmul": "bfloat16-matmul"}.get(chosen, chosen)
        if chosen not in WEIGHTS_DTYPES:
            where = "weights_dtype" if value is not None else "PARALLM_WEIGHTS_DTYPE"
            raise InvalidRequestError(f"{where} must be one of {', '.join(WEIGHTS_DTYPES)}, got {given!r}",
                                      param="weights_dtype")
    if device != "cpu":
        if chosen is not None:
            logger.info("weights_dtype=%s applies to the CPU backend; %s keeps the model's dtype", chosen, device)
        return None
    return chosen or "float32"


def bf16_dot_kernel():
    """The native kernels' module where they run bfloat16 matmuls with AVX512_BF16, else None."""
    from parallm_engine.runner import cpu_kernels  # imports MLX: loaded when a bf16 matmul first runs, not with the dtype names

    nat = cpu_kernels._native()
    return nat if nat is not None and getattr(nat, "has_bf16_dot", lambda: False)() else None


def _round_bf16(x):
    import mlx.core as mx

    return x.astype(mx.bfloat16).astype(mx.float32) if x.dtype == mx.float32 else x


def _bf16_matmul(x, weight, bias=None):
    """``bf16(x) @ weight.T (+ bias)`` for a bfloat16 ``weight`` in MLX ops (the native kernel's math:
    ``_packed_kernel``)."""
    y = _round_bf16(x) @ weight.T
    return y if bias is None else y + bias


def pack_panels(weight):
    """A bfloat16 (N, K) weight as the native ``linear_bf16_packed``'s panels: (ceil(N / 64), ceil(K / 2),
    64, 2), element [p, q, c, j] = weight[64 p + c, 2 q + j], zero past N and K."""
    import mlx.core as mx

    N, K = weight.shape
    Np, Kp = -(-N // 64) * 64, -(-K // 2) * 2
    w = mx.pad(weight, [(0, Np - N), (0, Kp - K)]) if (Np, Kp) != (N, K) else weight
    return mx.contiguous(w.reshape(Np // 64, 64, Kp // 2, 2).transpose(0, 2, 1, 3))


def unpack_panels(packed, n: int, k: int):
    """The (n, k) weight behind :func:`pack_panels`' panels."""
    P, Kq = packed.shape[0], packed.shape[1]
    return packed.transpose(0, 2, 1, 3).reshape(P * 64, Kq * 2)[:n, :k]


def named_weights(model) -> dict:
    """``model``'s parameters by name as a checkpoint holds them: a module whose weight is packed
    (:class:`_PackedWeight`) gives its ``weight`` back unpacked under that name."""
    from mlx.utils import tree_flatten

    out = {name: arr for name, arr in tree_flatten(model.parameters())
           if name != "packed" and not name.endswith(".packed")}
    for name, module in model.named_modules():
        if isinstance(module, _PackedWeight) and "packed" in module:
            out[f"{name}.weight" if name else "weight"] = module.weight
    return out


class _PackedWeight:
    """What a bf16-matmul module keeps once the native kernel has run it: the weight as panels only (held
    once). ``weight`` then reads back through :func:`unpack_panels` (a copy per use: the MLX-ops path
    outside the engine's forwards, e.g. a benchmark running mlx-lm on the same model object)."""

    @property
    def weight(self):
        packed = self.get("packed")
        return unpack_panels(packed, self._n_out, self._k_in) if packed is not None else self["weight"]

    @weight.setter
    def weight(self, value):
        self["weight"] = value

    def _panels(self):
        """The weight as panels, packing it on the first call (then dropping the (N, K) copy)."""
        import mlx.core as mx

        packed = self.get("packed")
        if packed is None:
            w = self["weight"]
            self._n_out, self._k_in = w.shape  # ints: kept out of the module's parameters
            packed = pack_panels(w)
            mx.eval(packed)
            self["packed"] = packed
            del self["weight"]
        return packed


def _packed_kernel(x, bias=None):
    """The native kernels where the packed kernel runs this call (inside the engine's forwards, float32
    input), else None."""
    import mlx.core as mx

    from parallm_engine.runner import cpu_kernels

    if cpu_kernels.is_enabled() and x.dtype == mx.float32 and (bias is None or bias.dtype == mx.float32):
        return bf16_dot_kernel()
    return None


@functools.lru_cache(maxsize=1)
def bf16_matmul_classes():
    """(Linear, Embedding) classes for ``weights_dtype="bfloat16-matmul"``: an ``nn.Linear`` and a
    :func:`bf16_embedding_class` whose tied head (``as_linear``) compute :func:`_bf16_matmul`. Where the
    native AVX512_BF16 kernels run them, the weights are packed into 64-column panels on first use
    (``linear_bf16_packed``: a broadcast-form microkernel, faster than a dot-form kernel on the unpacked
    weight at decode sizes: docs/benchmarks-archive.md, "Packed panels: a broadcast-form `vdpbf16ps`
    microkernel"); embedding lookups then gather rows from the panels."""
    import mlx.core as mx
    import mlx.nn as nn

    class Bf16MatmulLinear(_PackedWeight, nn.Linear):
        def __call__(self, x):
            bias = self.get("bias")
            nat = _packed_kernel(x, bias)
            if nat is not None:
                packed = self._panels()
                return nat.linear_bf16_packed(x, packed, self._n_out, bias)
            return _bf16_matmul(x, self.weight, bias)

    class Bf16MatmulEmbedding(_PackedWeight, bf16_embedding_class()):
        def __call__(self, x):
            packed = self.get("packed")
            if packed is None:
                return super().__call__(x)
            rows = packed.transpose(0, 2, 1, 3)[x // 64, x % 64]  # (..., ceil(K / 2), 2): row x's values
            return rows.reshape(*x.shape, -1)[..., : self._k_in].astype(mx.float32)

        def as_linear(self, x):
            nat = _packed_kernel(x)
            if nat is not None:
                packed = self._panels()
                return nat.linear_bf16_packed(x, packed, self._n_out)
            return _bf16_matmul(x, self.weight)

    for cls in (Bf16MatmulLinear, Bf16MatmulEmbedding):
        cls.__module__ = __name__
    return Bf16MatmulLinear, Bf16MatmulEmbedding


def store_weights_bf16(net, bf16_matmul: bool = False) -> int:
    """Cast every float32 ``nn.Linear`` / ``nn.Embedding`` weight of ``net`` (a float32 model) to
    bfloat16 in place; return how many. Norms, biases and everything else stay float32. With
    ``bf16_matmul`` those modules also round their matmul inputs to bfloat16 (:func:`bf16_matmul_classes`)."""
    import mlx.core as mx
    import mlx.nn as nn

    emb_cls = bf16_embedding_class()
    linear_cls = None
    if bf16_matmul:
        linear_cls, emb_cls = bf16_matmul_classes()
    count = 0
    for _, module in net.named_modules():
        embedding = type(module) is nn.Embedding  # a subclass may read its rows its own way: left float32
        if not (isinstance(module, nn.Linear) or embedding) or "weight" not in module:
            continue
        if module.weight.dtype != mx.float32:
            continue
        module.weight = module.weight.astype(mx.bfloat16)
        if embedding:
            module.__class__ = emb_cls
        elif linear_cls is not None and type(module) is nn.Linear:
            module.__class__ = linear_cls
        count += 1
    return count
