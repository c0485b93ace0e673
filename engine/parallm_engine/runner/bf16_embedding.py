"""The bfloat16-weight ``nn.Embedding`` (``weights_dtype="bfloat16"``): below both ``weights_dtype``, which
stores weights in it, and ``cpu_kernels``, which swaps its class for the native tied head; neither imports
the other for it. Made on first use, so importing this module loads no MLX."""

from __future__ import annotations


def _embedding_class():
    import mlx.core as mx
    import mlx.nn as nn

    class Bf16Embedding(nn.Embedding):
        """An ``nn.Embedding`` holding bfloat16 rows whose lookups come back float32 (exact), so the
        residual stream stays float32; a tied head (``as_linear``) promotes to float32 by itself."""

        def __call__(self, x):
            return super().__call__(x).astype(mx.float32)

    Bf16Embedding.__module__, Bf16Embedding.__qualname__ = __name__, "Bf16Embedding"
    return Bf16Embedding


_BF16_EMBEDDING = None


def bf16_embedding_class():
    global _BF16_EMBEDDING
    if _BF16_EMBEDDING is None:
        _BF16_EMBEDDING = _embedding_class()
    return _BF16_EMBEDDING
