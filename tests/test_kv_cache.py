"""KV layout invariants: a batched prefill's per-row views hand out exactly the row's tokens, and the
decode batch keeps every row's keys right-aligned at the shared write column after joins and leaves."""

from __future__ import annotations

import mlx.core as mx
import pytest
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


@settings(max_examples=40, deadline=None)
@given(tails=st.lists(st.tuples(st.booleans(), st.integers(1, 7)), min_size=1, max_size=5),
       P=st.integers(1, 6), steps=st.integers(0, 2), drop=st.integers(0, 4),
       a=st.integers(0, 14), w=st.integers(1, 14))
def test_shared_prefix_rows_hand_out_prefix_and_own_tokens(tails, P, steps, drop, a, w):
    """Rows continuing a shared prefix store only their later tokens, yet ``row`` (what the radix tree
    receives) and ``offset`` (RoPE positions) count from the sequence's first token."""
    kv = BatchKV()
    prefix = _row(-1000, P)  # prefix token t has tag -1000 + t
    kv.set_shared(prefix, prefix)
    rows, expect = [], []
    for j, (uses, n) in enumerate(tails):
        own = _row(100 * j + (P if uses else 0), n)  # own tokens continue the numbering after P
        rows.append((own, own))
        expect.append(([-1000 + t for t in range(P)] if uses else []) + [100 * j + (P if uses else 0) + t for t in range(n)])
    kv.add(rows, [u for u, _ in tails])
    for s in range(steps):
        new = mx.full((kv.batch_size, 2, 1, 3), float(10_000 + s))
        kv.update_and_fetch(new, new)
        expect = [e + [10_000 + s] for e in expect]
    keep = [i for i in range(len(expect)) if i != drop] or [0]
    kv.keep(keep)
    expect = [expect[i] for i in keep]
    uses = [tails[i][0] for i in keep]
    assert (kv.shared_mask is None) == all(uses)
    for r, e in enumerate(expect):
        assert int(np.array(kv.offset)[r]) == len(e)
        start = min(a, len(e) - 1)
        end = min(start + w, len(e))
        k, v = kv.row(r, start, end)
        np.testing.assert_array_equal(np.array(k)[0, 1, :, 2], e[start:end])
    assert kv.nbytes() == kv.keys.nbytes + kv.values.nbytes  # the prefix is counted by its owner


def test_shared_prefix_cannot_change_under_rows_using_it():
    kv = BatchKV()
    prefix = _row(0, 4)
    kv.set_shared(prefix, prefix)
    kv.add([(_row(4, 2), _row(4, 2))], [True])
    with pytest.raises(AssertionError):
        kv.set_shared(None, None)
    kv.keep([])
    kv.set_shared(None, None)
    with pytest.raises(ValueError):
        kv.add([(_row(4, 2), _row(4, 2))], [True])
