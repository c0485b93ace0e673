"""KV layout invariants of a batched prefill into pages (``paged_prefill``): each row's tokens land in
the columns the prefill's mask expects, only real positions are written, and padding reads zeros (the
decode rows' paged KV is tested in test_kv_pages.py)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallm_engine.kv.kv_pages import PagedLaneKV
from parallm_engine.kv.paged_prefill import PagedPrefillStep, PrefillRow


def _marked(i: int, tokens: range, KH: int = 2, D: int = 3) -> mx.array:
    """(1, KH, n, D) keys whose value is 100 * row + token (never 0: zeros mark what nobody wrote)."""
    vals = np.array([[[100 * i + t + 1] * D for t in tokens]] * KH, dtype=np.float32)
    return mx.array(vals[None])


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 9)), min_size=1, max_size=4),
       deferred=st.booleans())
def test_prefill_rows_map_tokens_to_columns_and_write_only_real_positions(rows, deferred):
    """Written in the forward (then attention reads the pool) or deferred (attention reads the held tokens
    from the pool and the new ones as computed; the step's commit writes them): the same columns."""
    kv = PagedLaneKV(1)
    lane = SimpleNamespace(kv=kv)
    held = []
    for i, (p, _) in enumerate(rows):
        k = _marked(i, range(p))
        row = kv.open_row(np.zeros(0, dtype=np.int32), [(k, k + 0.5)] if p else None)
        held.append(PrefillRow(lane, row, 0))
    step = PagedPrefillStep(kv, held, [n for _, n in rows], None, deferred=deferred)
    P, L = max(p for p, _ in rows), max(n for _, n in rows)
    new = mx.zeros((len(rows), 2, L, 3))
    for i, (p, n) in enumerate(rows):  # padding positions stay -1: they must never be stored
        new[i : i + 1] = mx.concatenate([mx.full((1, 2, L - n, 3), -1.0), _marked(i, range(p, p + n))], axis=2)
    keys, values = step.layers[0].update_and_fetch(new, new + 0.5)
    mx.eval(step.arrays())
    mx.eval(step.commit())
    keys, values = np.array(keys), np.array(values)
    assert keys.shape == (len(rows), 2, P + L, 3)
    for i, (p, n) in enumerate(rows):
        cols = list(range(P - p, P)) + list(range(P + L - n, P + L))
        np.testing.assert_array_equal(keys[i, 1, cols, 2], 100 * i + np.arange(p + n) + 1)
        np.testing.assert_array_equal(values[i, 0, cols, 0], 100 * i + np.arange(p + n) + 1.5)
        holes = [c for c in range(P if deferred else P + L) if c not in cols]
        assert not keys[i, :, holes].any()  # padding columns read from the pool read page 0: zeros
        assert held[i].row.length == p + n
    pool = np.array(kv.layers[0].keys)
    assert not (pool == -1).any()  # no padding position was written
    assert kv.meter.written == sum(p + n for p, n in rows) * 2 * 2 * 3 * 4  # keys and values, once each


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=300), st.lists(st.integers(0, 3), max_size=300),
       st.one_of(st.none(), st.integers(0, 320)))
def test_common_prefix_len_is_the_first_difference(a, b, limit):
    """The planner's and the prefix sharing's common prefix (halved by slice compares) == a plain scan."""
    from parallm_engine.kv.radix_cache import common_prefix_len

    shared = a[: len(a) // 2]
    b = shared + b  # long common prefixes too, not only the random ones
    a = shared + a
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    assert common_prefix_len(a, b, limit) == i
