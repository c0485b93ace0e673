"""A decode step and the step's prefill work in one forward (a "fused" step, as vLLM v1 runs steps).

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

from parallm_engine.kv.pipeline_tie import PipelineTie


class FusedLayerKV(PipelineTie):
    """One layer of a fused step, as mlx-lm's models call a cache: ``offset`` (each model row's position),
    ``update_and_fetch`` (writes every part; the keys and values returned are the decode part's, stand-ins:
    the hook reads :attr:`fused`), ``make_mask`` (None: each part has its own)."""

    def __init__(self, decode, parts: list[tuple], rows: int, offset: mx.array):
        self.decode = decode  # kv_pages.PagedLayerKV: the lane's decode rows
        # (paged_prefill.PagedPrefillKV, PromptLayout) per prefill item: each item's prompts are one
        # rectangle (a short prompt is not padded to another item's long chunk)
        self.parts = parts
        self.rows = rows  # decode rows: model rows [0, rows); the prompts' positions follow
        self.offset = offset
        self.fetched: list = []

    @property
    def fused(self) -> "FusedLayerKV":
        return self

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B = self.rows
        for prompts, layout in self.parts:
            a, b = B + layout.start, B + layout.start + layout.n
            prompts.write(layout.rect(keys[a:b]), layout.rect(values[a:b]))
        out = self.decode.update_and_fetch(keys[:B], values[:B])
        self.fetched = [prompts.fetch() for prompts, _ in self.parts]
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return None


class PromptLayout:
    """Where the prompts' model rows (row i's ``n_i`` positions, row by row, from the ``start``-th of the
    step's prompt positions) sit in their prefill rectangle (R, L): right-aligned, as
    ``kv_cache.prefill_layout`` lays a batched prefill out. A cell no position fills repeats the first one
    (computed, never written, never read back)."""

    def __init__(self, new: list[int], start: int = 0):
        L = max(new)
        self.R, self.L = len(new), L
        self.start, self.n = start, sum(new)
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
    outs = [attend(queries[:B], keys, values, cache.decode, scale, cache.decode.make_mask(1), sinks)]
    for (prompts, layout), (k, v) in zip(cache.parts, cache.fetched):
        q = layout.rect(queries[B + layout.start : B + layout.start + layout.n])
        outs.append(layout.rows(attend(q, k, v, prompts, scale, prompts.make_mask(layout.L), sinks)))
    cache.fetched = []
    return mx.concatenate(outs)


class FusedWork:
    """The prefill work a decode step computes beside its rows: ``new[i]`` more context tokens of each
    ``seqs[i]``, already counted as prefilled (their positions advanced, their rows grown by the pages the
    new tokens take: ``ModelRunner.prefill``), with ``rows[i]`` its ``paged_prefill.PrefillRow`` (kept here:
    a prompt the work finishes has joined the batch) and ``tokens[i]`` the new tokens; ``split``: the model's
    hidden-state forward and head (``logits_head.split_head``). Once built, ``arrays``: what evaluating the
    forward must compute besides the logits (the pools the prompts wrote: no logit depends on them where
    the decode rows read a kept working set); ``ran``: the decode step took it."""

    def __init__(self, split):
        self.seqs: list = []
        self.new: list[int] = []
        self.rows: list = []
        self.tokens: list[list[int]] = []
        self.split = split
        self.items = 0  # the scheduler's prefill items (chunks, groups) this work gathers
        self.item_of: list[int] = []  # each row's item
        self.arrays: list = []
        self.ran = False

    def add(self, seqs: list, new: list[int], rows: list, tokens: list[list[int]]) -> None:
        """One more prefill item of the step (each item's prompts are distinct: a prompt runs once a step)."""
        self.seqs += seqs
        self.new += new
        self.rows += rows
        self.tokens += tokens
        self.item_of += [self.items] * len(seqs)
        self.items += 1

    @property
    def n_tokens(self) -> int:
        return sum(self.new)

    def finishes(self) -> bool:
        """Whether a prompt of the work joined the batch (then the decode step must take the work)."""
        return any(s.cache is None for s in self.seqs)

    def in_lane(self, lane) -> list[int]:
        """Indices of the work's rows in ``lane``'s pool."""
        return [i for i, r in enumerate(self.rows) if r.lane is lane]

    def by_item(self, mine: list[int]) -> list[list[int]]:
        """``mine`` (indices in order) cut into runs of one item each."""
        runs: list[list[int]] = []
        for i in mine:
            if runs and self.item_of[runs[-1][-1]] == self.item_of[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs
