"""A decode step and one prompt's chunk in one forward (a "fused" step, as vLLM v1 runs every step).

Without it a step runs the chunk's forward, then the decode rows' forward: each reads every weight, and
the streams' inter-token latency is the sum of both. Fused, the model runs once over N = B + n positions,
one per model row (the B decode rows' next positions, then the chunk's n positions, as a ragged step lays
them out), so the projections and MLPs read the weights once for both. Attention stays two problems,
each exactly what it is in a step of its own: the decode rows over their pages (``kv_pages.PagedLayerKV``:
the kept working set, the native kernel or the CUDA kernel reading the pool, the shared prefix), the
chunk over its row's held tokens and itself (``paged_prefill.PagedPrefillKV``). The engine's attention
hook (``cpu_kernels._engine_sdpa``) sees :attr:`FusedLayerKV.fused` and runs the two; the chunk's own
logits are never computed (``logits_head``). So every row's sums are those of the unfused step.

The chunk never ends its prompt (the scheduler plans only such chunks here), so its prompt's last token
still runs in a decode step as before, and nothing about joining or committing changes.

The chunk's keys and values are written into the pool before the decode rows' are, and both before either
is read: MLX writes a pool array in place only when nothing still to run reads it.
"""

from __future__ import annotations

import mlx.core as mx


class FusedLayerKV:
    """One layer of a fused step, as mlx-lm's models call a cache: ``offset`` (each model row's position),
    ``update_and_fetch`` (writes both parts; the keys and values returned are the decode part's, stand-ins:
    the hook reads :attr:`fused`), ``make_mask`` (None: each part has its own)."""

    def __init__(self, decode, chunk, rows: int, offset: mx.array):
        self.decode = decode  # kv_pages.PagedLayerKV: the lane's decode rows
        self.chunk = chunk  # paged_prefill.PagedPrefillKV: the chunk's row
        self.rows = rows  # decode rows: model rows [0, rows); the chunk's positions follow
        self.offset = offset
        self.chunk_keys = self.chunk_values = None

    @property
    def fused(self) -> "FusedLayerKV":
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B = self.rows
        # (n, KH, 1, D) model rows -> the chunk's (1, KH, n, D)
        self.chunk.write(keys[B:].transpose(2, 1, 0, 3), values[B:].transpose(2, 1, 0, 3))
        out = self.decode.update_and_fetch(keys[:B], values[:B])
        self.chunk_keys, self.chunk_values = self.chunk.fetch()
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return None


def fused_attention(attend, queries: mx.array, keys, values, cache: FusedLayerKV, scale: float, sinks):
    """The hook's attention of a fused step: queries (N, H, 1, D), the decode rows' first. ``attend`` is
    the hook's attention of one cache (``cpu_kernels._engine_sdpa``)."""
    B = cache.rows
    n = queries.shape[0] - B
    out = attend(queries[:B], keys, values, cache.decode, scale, cache.decode.make_mask(1), sinks)
    chunk = attend(queries[B:].transpose(2, 1, 0, 3), cache.chunk_keys, cache.chunk_values, cache.chunk, scale,
                   cache.chunk.make_mask(n), sinks)
    cache.chunk_keys = cache.chunk_values = None
    return mx.concatenate([out, chunk.transpose(2, 1, 0, 3)])


def chunk_offsets(step, n: int) -> mx.array:
    """The chunk's n positions (``paged_prefill.PagedPrefillStep`` of one row: its first new token's)."""
    return step.offset[0] + mx.arange(n, dtype=step.offset.dtype)


class FusedChunk:
    """The chunk a decode step computes beside its rows: ``n`` more context tokens of ``seq`` (whose
    ``PrefillRow`` is open in a running lane), the model's ``split`` (``logits_head.split_head``), and,
    once the forward is built, ``arrays``: what evaluating it must compute besides the logits (the pools
    the chunk wrote: no logit depends on them where the decode rows read a kept working set)."""

    __slots__ = ("seq", "n", "split", "arrays", "ran")

    def __init__(self, seq, n: int, split):
        self.seq = seq
        self.n = n
        self.split = split
        self.arrays: list = []
        self.ran = False

    @property
    def lane(self):
        return self.seq.cache.lane

    def tokens(self) -> list[int]:
        return self.seq.prefill_ids[self.seq.pos : self.seq.pos + self.n]
