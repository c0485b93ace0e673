"""KV layout invariants: a batched prefill's per-row views hand out exactly the row's tokens, and the
decode batch keeps every row's keys right-aligned at the shared write column after joins and leaves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallm_engine.kv_cache import BatchKV, PrefillBatchKV


def _row(tag: float, length: int, H: int = 2, D: int = 3) -> mx.array:
    """(1, H, length, D) whose [.., t, ..] entries are tag + t: position-identifying values."""
    t = np.arange(length, dtype=np.float32)[None, None, :, None]
    return mx.array(np.broadcast_to(tag + t, (1, H, length, D)).copy())


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=4),
       a=st.integers(0, 12), w=st.integers(0, 12))
def test_prefill_row_views_map_tokens_to_columns(rows, a, w):
    P, L = max(p for p, _ in rows), max(n for _, n in rows)
    B = len(rows)
    block = np.full((B, 2, P + L, 3), -1.0, dtype=np.float32)  # -1 marks holes
    for i, (p, n) in enumerate(rows):
        for t in range(p + n):
            col = P - p + t if t < p else P + L - n + (t - p)
            block[i, :, col, :] = 100 * i + t
    kv = PrefillBatchKV(None, None, None, None)
    kv.keys, kv.values = mx.array(block), mx.array(block + 0.5)
    for i, (p, n) in enumerate(rows):
        view = kv.row(i, p, n, P, L)
        k, v = view.valid()
        assert view.offset == p + n
        np.testing.assert_array_equal(np.array(k)[0, 0, :, 0], 100 * i + np.arange(p + n))
        np.testing.assert_array_equal(np.array(v)[0, 0, :, 0], 100 * i + np.arange(p + n) + 0.5)
        start = min(a, p + n)
        end = min(start + w, p + n)
        if end > start:
            sk, sv = view.segment(start, end)
            np.testing.assert_array_equal(np.array(sk)[0, 1, :, 2], 100 * i + np.arange(start, end))
            np.testing.assert_array_equal(np.array(sv)[0, 1, :, 2], 100 * i + np.arange(start, end) + 0.5)


@settings(max_examples=40, deadline=None)
@given(first=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       second=st.lists(st.integers(1, 12), min_size=1, max_size=3),
       steps=st.integers(0, 3), keep_mask=st.lists(st.booleans(), min_size=6, max_size=6))
def test_batch_rows_stay_right_aligned_through_joins_and_leaves(first, second, steps, keep_mask):
    kv = BatchKV()
    expect: list[list[float]] = []  # each row's valid key tags, oldest first
    kv.add([(_row(100 * j, n), _row(100 * j, n)) for j, n in enumerate(first)])
    expect += [[100 * j + t for t in range(n)] for j, n in enumerate(first)]
    for s in range(steps):  # decode steps append one column to every row
        tag = 10_000 + s
        new = mx.full((kv.batch_size, 2, 1, 3), float(tag))
        kv.update_and_fetch(new, new)
        expect = [e + [tag] for e in expect]
    base = 100 * len(first)
    kv.add([(_row(base + 100 * j, n), _row(base + 100 * j, n)) for j, n in enumerate(second)])
    expect += [[base + 100 * j + t for t in range(n)] for j, n in enumerate(second)]
    keep = [i for i in range(len(expect)) if keep_mask[i]] or [0]
    kv.keep(keep)
    expect = [expect[i] for i in keep]
    keys = np.array(kv.keys)
    assert kv.idx == max(len(e) for e in expect)
    assert min(kv.left_pad) == 0
    for r, e in enumerate(expect):
        lp = kv.left_pad[r]
        assert lp == kv.idx - len(e)
        np.testing.assert_array_equal(keys[r, 0, lp : kv.idx, 0], e)
        np.testing.assert_array_equal(np.array(kv.offset)[r], len(e))
