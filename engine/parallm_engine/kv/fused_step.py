"""A decode step and the step's last prefill work in one forward (a "fused" step, as vLLM v1 runs steps).

Without it a step runs the prefill forward, then the decode rows' forward: each reads every weight, and
the streams' inter-token latency is the sum of both. Fused, the model runs once over N = B + n positions,
one per model row (the B decode rows' next positions, then the prompts' n new positions, row by row, as a
ragged step lays them out), so the projections and MLPs read the weights once for both. Attention stays
two problems, each exactly what it is in a step of its own: the decode rows over their pages
(``kv_pages.PagedLayerKV``: the kept working set, the native kernel or the CUDA kernel reading the pool,
the shared prefix), the prompts over their held tokens and themselves, laid out as a prefill step's
rectangle (``paged_prefill.PagedPrefillStep``). The engine's attention hook (``cpu_kernels._engine_sdpa``)
sees :attr:`FusedLayerKV.fused` and runs the two; the prompts' own logits are never computed
(``logits_head``). So every row's sums are those of the unfused step.

A prompt the work finishes joins the decode rows before the forward (its pages grown for the new tokens
first, so the radix tree can hold them): its last context token is one of the B decode positions, and it
reads, in each layer, the keys its new tokens wrote just before in the same layer. The prompts' keys and
values are written into the pool before the decode rows' are, and both before either is read: MLX writes
a pool array in place only when nothing still to run reads it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class FusedLayerKV:
    """One layer of a fused step, as mlx-lm's models call a cache: ``offset`` (each model row's position),
    ``update_and_fetch`` (writes both parts; the keys and values returned are the decode part's, stand-ins:
    the hook reads :attr:`fused`), ``make_mask`` (None: each part has its own)."""

    def __init__(self, decode, prompts, rows: int, layout: "PromptLayout", offset: mx.array):
        self.decode = decode  # kv_pages.PagedLayerKV: the lane's decode rows
        self.prompts = prompts  # paged_prefill.PagedPrefillKV: the prompts' rows
        self.rows = rows  # decode rows: model rows [0, rows); the prompts' positions follow
        self.layout = layout
        self.offset = offset
        self.prompt_keys = self.prompt_values = None

    @property
    def fused(self) -> "FusedLayerKV":
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B = self.rows
        self.prompts.write(self.layout.rect(keys[B:]), self.layout.rect(values[B:]))
        out = self.decode.update_and_fetch(keys[:B], values[:B])
        self.prompt_keys, self.prompt_values = self.prompts.fetch()
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return None


class PromptLayout:
    """Where the prompts' model rows (row i's ``n_i`` positions, row by row) sit in their prefill
    rectangle (R, L): right-aligned, as ``kv_cache.prefill_layout`` lays a batched prefill out. A cell no
    position fills repeats the first one (computed, never written, never read back)."""

    def __init__(self, new: list[int]):
        L = max(new)
        self.R, self.L = len(new), L
        cells = np.concatenate([i * L + L - n + np.arange(n) for i, n in enumerate(new)]).astype(np.int32)
        fill = np.zeros(self.R * L, dtype=np.int32)
        fill[cells] = np.arange(len(cells), dtype=np.int32)
        self.padded = len(cells) < self.R * L
        self.cells, self.fill = mx.array(cells), mx.array(fill)

    def rect(self, x: mx.array) -> mx.array:
        """(n, heads, 1, D) model rows -> (R, heads, L, D)."""
        n, H, _, D = x.shape
        x = x.reshape(n, H, D)
        if self.padded:
            x = x[self.fill]
        return x.reshape(self.R, self.L, H, D).transpose(0, 2, 1, 3)

    def rows(self, x: mx.array) -> mx.array:
        """(R, heads, L, D) -> (n, heads, 1, D) model rows."""
        R, H, L, D = x.shape
        x = x.transpose(0, 2, 1, 3).reshape(R * L, H, D)
        if self.padded:
            x = x[self.cells]
        return x.reshape(-1, H, 1, D)


def fused_attention(attend, queries: mx.array, keys, values, cache: FusedLayerKV, scale: float, sinks):
    """The hook's attention of a fused step: queries (N, H, 1, D), the decode rows' first. ``attend`` is
    the hook's attention of one cache (``cpu_kernels._engine_sdpa``)."""
    B = cache.rows
    out = attend(queries[:B], keys, values, cache.decode, scale, cache.decode.make_mask(1), sinks)
    prompts = attend(cache.layout.rect(queries[B:]), cache.prompt_keys, cache.prompt_values, cache.prompts,
                     scale, cache.prompts.make_mask(cache.layout.L), sinks)
    cache.prompt_keys = cache.prompt_values = None
    return mx.concatenate([out, cache.layout.rows(prompts)])


class FusedWork:
    """The prefill work a decode step computes beside its rows: ``new[i]`` more context tokens of each
    ``seqs[i]``, already counted as prefilled (their positions advanced, their rows grown by the pages the
    new tokens take: ``ModelRunner.prefill``), with ``rows[i]`` its ``paged_prefill.PrefillRow`` (kept here:
    a prompt the work finishes has joined the batch) and ``tokens[i]`` the new tokens; ``split``: the model's
    hidden-state forward and head (``logits_head.split_head``). Once built, ``arrays``: what evaluating the
    forward must compute besides the logits (the pools the prompts wrote: no logit depends on them where
    the decode rows read a kept working set); ``ran``: the decode step took it."""

    def __init__(self, seqs: list, new: list[int], rows: list, tokens: list[list[int]], split):
        self.seqs, self.new, self.rows, self.tokens = seqs, new, rows, tokens
        self.split = split
        self.arrays: list = []
        self.ran = False

    @property
    def n_tokens(self) -> int:
        return sum(self.new)

    def finishes(self) -> bool:
        """Whether a prompt of the work joined the batch (then the decode step must take the work)."""
        return any(s.cache is None for s in self.seqs)

    def in_lane(self, lane) -> list[int]:
        """Indices of the work's rows in ``lane``'s pool."""
        return [i for i, r in enumerate(self.rows) if r.lane is lane]
