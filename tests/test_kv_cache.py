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


_OPS = st.lists(st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(1, 6), min_size=1, max_size=2)),
    st.tuples(st.just("step"), st.integers(1, 1)),
    st.tuples(st.just("verify"), st.lists(st.integers(0, 5), min_size=6, max_size=6)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(st.just("compact"), st.integers(0, 0)),
), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(first=st.lists(st.integers(1, 8), min_size=1, max_size=3), ops=_OPS, shared=st.booleans(),
       holes=st.booleans())
def test_rows_that_keep_different_verified_positions_read_exactly_their_tokens(first, ops, shared, holes):
    """Speculative steps write W columns per row and each row keeps its own count (holes in the rest):
    through any sequence of joins, plain steps, verifies, drops and compactions every row's positions,
    its attention mask's columns and what ``row`` hands the radix tree are exactly its tokens, in order.
    Without holes (``holes=False``) a verify closes them at once: the largest offset is the column count."""
    kv = BatchKV(holes=holes)
    P = 3 if shared else 0
    if shared:
        prefix = _row(-1000, P)
        kv.set_shared(prefix, prefix + 0.5)
    tag = iter(range(1, 10**6))
    expect: list[list[float]] = []

    def join(lengths):
        rows = []
        for n in lengths:
            tags = [float(next(tag)) for _ in range(n)]
            x = mx.array(np.broadcast_to(np.array(tags, np.float32)[None, None, :, None], (1, 2, n, 3)).copy())
            rows.append((x, x + 0.5))
            expect.append(([-1000.0 + t for t in range(P)]) + tags)
        kv.add(rows, [shared] * len(rows))

    join(first)
    for op, arg in ops:
        if op == "join":
            join(arg)
        elif op == "step":
            t = [float(next(tag)) for _ in expect]
            kv.update_and_fetch(mx.array(t)[:, None, None, None] * mx.ones((1, 2, 1, 3)),
                                mx.array(t)[:, None, None, None] * mx.ones((1, 2, 1, 3)) + 0.5)
            for e, x in zip(expect, t):
                e.append(x)
        elif op == "verify":
            W = 5
            t = [[float(next(tag)) for _ in range(W)] for _ in expect]
            x = mx.array(t)[:, None, :, None] * mx.ones((1, 2, 1, 3))
            mask = kv.make_mask(W)  # built before the write, as the model does
            kv.update_and_fetch(x, x + 0.5)
            keeps = [arg[i % len(arg)] for i in range(len(expect))]
            kv.rollback_rows(W, keeps)
            for e, row, k in zip(expect, t, keeps):
                e.extend(row[:k])
            assert mask is not None
            if not holes:
                assert not any(kv.holes) and max(np.array(kv.offset).tolist()) - P == kv.idx
        elif op == "drop" and len(expect) > 1:
            keep = [i for i in range(len(expect)) if i != arg % len(expect)]
            kv.keep(keep)
            expect = [expect[i] for i in keep]
        elif op == "compact":
            kv.compact()
            assert not any(kv.holes) and kv.filled is None
        # every row: its RoPE position, the columns its next query attends to, and what the tree gets
        offsets = np.array(kv.offset).tolist()
        mask = kv.make_mask(1)
        keys = None if kv.keys is None else np.array(kv.keys[..., : kv.idx, :])
        for r, e in enumerate(expect):
            assert offsets[r] == len(e)
            own = e[P:]
            if keys is not None:
                seen = np.ones(kv.idx + 1, bool) if mask is None else np.array(mask)[r, 0, 0]
                cols = [c for c in range(kv.idx) if seen[c]]
                np.testing.assert_array_equal(keys[r, 0, cols, 0], own)
            if len(e):
                k, v = kv.row(r, 0, len(e))
                np.testing.assert_array_equal(np.array(k)[0, 1, :, 2], e)
                np.testing.assert_array_equal(np.array(v)[0, 0, :, 0], np.array(e) + 0.5)
                if len(e) > 2:
                    k, _ = kv.row(r, 1, len(e) - 1)
                    np.testing.assert_array_equal(np.array(k)[0, 0, :, 1], e[1:-1])
        assert kv.filled is None or kv.filled.shape[1] <= kv.idx
