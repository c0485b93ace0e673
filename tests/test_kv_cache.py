"""KV layout invariants of a batched prefill: its per-row views hand out exactly the row's tokens (the
decode rows' paged KV is tested in test_kv_pages.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallm_engine.kv.kv_cache import PrefillBatchKV


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=4),
       a=st.integers(0, 12))
def test_prefill_row_views_map_tokens_to_columns(rows, a):
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
        if start < p + n:  # what a row that reads its first tokens elsewhere stores
            sk, sv = view.tail(start)
            np.testing.assert_array_equal(np.array(sk)[0, 1, :, 2], 100 * i + np.arange(start, p + n))
            np.testing.assert_array_equal(np.array(sv)[0, 1, :, 2], 100 * i + np.arange(start, p + n) + 0.5)
