"""ParaLLM's native CPU kernels (``parallm_engine.native``): they build on this machine, match MLX's own
ops, and give a row the same bits whatever its padding, its batch, or where its prefix is held."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lm.models.base import create_causal_mask

from parallm_engine import native

from parallm_engine.runner import cpu_kernels

pytestmark = pytest.mark.skipif(not native.supported_platform(), reason="native kernels are built on Linux only")

SDPA = mx.fast.scaled_dot_product_attention


@pytest.fixture(scope="module")
def nat():
    module = native.load()
    # scripts/setup installs g++ and nanobind: on Linux CI a missing build is a failure, not a skip.
    assert module is not None, native.status()
    return module


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=tol, rtol=tol)


def _left_pad_mask(pads: list[int], T: int) -> mx.array:
    return (mx.arange(T)[None, :] >= mx.array(pads)[:, None]).reshape(len(pads), 1, 1, T)


@pytest.mark.parametrize("H,KH,D", [(9, 3, 64), (8, 2, 128), (4, 4, 40), (6, 1, 16)])
def test_decode_attention_matches_mlx(nat, H, KH, D):
    mx.random.seed(D + H)
    B, cap, T = 5, 64, 37
    q = mx.random.normal((B, H, 1, D))
    # Keys and values as the decode batch hands them over: a view of the first T columns of a buffer.
    k = (mx.random.normal((B, KH, cap, D)) * 2)[..., :T, :]
    v = mx.random.normal((B, KH, cap, D))[..., :T, :]
    scale = D**-0.5
    _close(nat.attention(q, k, v, scale), SDPA(q, k, v, scale=scale))
    mask = _left_pad_mask([0, 3, 10, 36, 1], T)
    _close(nat.attention(q, k, v, scale, mask), SDPA(q, k, v, scale=scale, mask=mask))


def test_decode_attention_shared_prefix_matches_concatenation(nat):
    mx.random.seed(7)
    B, H, KH, D, P, T = 4, 9, 3, 64, 50, 12
    q = mx.random.normal((B, H, 1, D))
    k, v = mx.random.normal((B, KH, T, D)), mx.random.normal((B, KH, T, D))
    sk, sv = mx.random.normal((1, KH, P, D)), mx.random.normal((1, KH, P, D))
    mask = _left_pad_mask([0, 2, 5, 11], T)
    full_k = mx.concatenate([mx.broadcast_to(sk, (B, KH, P, D)), k], axis=2)
    full_v = mx.concatenate([mx.broadcast_to(sv, (B, KH, P, D)), v], axis=2)
    full_mask = mx.concatenate([mx.ones((B, 1, 1, P), mx.bool_), mask], axis=-1)
    got = nat.attention(q, k, v, D**-0.5, mask, shared_keys=sk, shared_values=sv)
    _close(got, SDPA(q, full_k, full_v, scale=D**-0.5, mask=full_mask))
    # Rows 1 and 3 do not continue the prefix: they attend to their own columns only.
    uses = mx.array([True, False, True, False])
    got = nat.attention(q, k, v, D**-0.5, mask, shared_keys=sk, shared_values=sv, shared_mask=uses)
    no_prefix = SDPA(q, k, v, scale=D**-0.5, mask=mask)
    with_prefix = SDPA(q, full_k, full_v, scale=D**-0.5, mask=full_mask)
    _close(got, mx.where(uses.reshape(B, 1, 1, 1), with_prefix, no_prefix))


def test_row_result_is_bitwise_independent_of_padding_batch_and_prefix_placement(nat):
    """What makes batched greedy decoding equal to sequential: a row's attention output has the same
    bits alone, left-padded inside a batch, and with its prefix held once for the batch."""
    mx.random.seed(3)
    H, KH, D, P, n = 9, 3, 64, 40, 17
    q = mx.random.normal((1, H, 1, D))
    own_k, own_v = mx.random.normal((1, KH, n, D)), mx.random.normal((1, KH, n, D))
    sk, sv = mx.random.normal((1, KH, P, D)), mx.random.normal((1, KH, P, D))
    row_k = mx.concatenate([sk, own_k], axis=2)
    row_v = mx.concatenate([sv, own_v], axis=2)
    alone = nat.attention(q, row_k, row_v, 0.125)

    # In a batch of 3, padded on the left by 9 columns, next to unrelated rows.
    pad = 9
    T = P + n + pad
    others_k, others_v = mx.random.normal((3, KH, T, D)), mx.random.normal((3, KH, T, D))
    zeros = mx.zeros((1, KH, pad, D))
    batch_k = mx.concatenate([others_k[:1], mx.concatenate([zeros, row_k], axis=2), others_k[2:]])
    batch_v = mx.concatenate([others_v[:1], mx.concatenate([zeros, row_v], axis=2), others_v[2:]])
    qs = mx.concatenate([mx.random.normal((1, H, 1, D)), q, mx.random.normal((1, H, 1, D))])
    batched = nat.attention(qs, batch_k, batch_v, 0.125, _left_pad_mask([0, pad, 4], T))[1:2]
    assert np.array_equal(np.array(alone), np.array(batched))

    # With the prefix held once: the row stores only its own columns.
    shared = nat.attention(q, own_k, own_v, 0.125, shared_keys=sk, shared_values=sv)
    assert np.array_equal(np.array(alone), np.array(shared))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 70), rep=st.sampled_from([1, 2, 3]), seed=st.integers(0, 10_000),
       data=st.data())
def test_decode_attention_property(nat, B, T, rep, seed, data):
    pads = data.draw(st.lists(st.integers(0, T - 1), min_size=B, max_size=B))
    mx.random.seed(seed)
    KH, D = 2, 32
    q = mx.random.normal((B, KH * rep, 1, D))
    k, v = mx.random.normal((B, KH, T, D)) * 3, mx.random.normal((B, KH, T, D))
    mask = _left_pad_mask(pads, T)
    _close(nat.attention(q, k, v, 0.2, mask), SDPA(q, k, v, scale=0.2, mask=mask), tol=5e-5)


@pytest.mark.parametrize("L,cached", [(1, 0), (5, 0), (17, 0), (9, 30), (40, 70)])
@pytest.mark.parametrize("D", [64, 40])
def test_prefill_attention_causal_matches_mlx(nat, L, cached, D):
    """Several query positions per row (prefill), causal over the chunk and everything cached before
    it (MLX's "causal" is aligned to the last key); in blocks of positions (D 64) or one position at a
    time (D 40, not a multiple of 8)."""
    mx.random.seed(L * 100 + cached + D)
    B, H, KH, T = 2, 9, 3, cached + L
    q = mx.random.normal((B, H, L, D))
    k, v = mx.random.normal((B, KH, T, D)) * 2, mx.random.normal((B, KH, T, D))
    want = SDPA(q, k, v, scale=D**-0.5, mask="causal")
    _close(nat.attention(q, k, v, D**-0.5, None, L > 1), want)
    _close(cpu_kernels._native_attention(q, k, v, D**-0.5, "causal"), want)


def test_a_position_has_the_same_bits_in_any_chunk_batch_or_decode_step(nat):
    """A position's attention output has the same bits computed in a 50-position prefill chunk or a
    7-position one (other blocks), as a decode step's single position, left-padded in a batch next to
    other rows, and with its prefix held once for the batch instead of in the row."""
    mx.random.seed(5)
    H, KH, D, P, n = 9, 3, 64, 37, 50
    q = mx.random.normal((1, H, n, D))
    own_k, own_v = mx.random.normal((1, KH, n, D)) * 2, mx.random.normal((1, KH, n, D))
    sk, sv = mx.random.normal((1, KH, P, D)) * 2, mx.random.normal((1, KH, P, D))
    row_k, row_v = mx.concatenate([sk, own_k], axis=2), mx.concatenate([sv, own_v], axis=2)
    whole = np.array(nat.attention(q, row_k, row_v, 0.125, None, True))
    # The last 7 positions as their own chunk: keys up to each of them.
    tail = np.array(nat.attention(q[:, :, -7:], row_k, row_v, 0.125, None, True))
    assert np.array_equal(whole[:, :, -7:], tail)
    # The last position as a decode step (one query, every key).
    assert np.array_equal(whole[:, :, -1:], np.array(nat.attention(q[:, :, -1:], row_k, row_v, 0.125)))
    # Left-padded by 11 columns in a batch of 2 (a boolean mask: causal and the padding).
    pad, T = 11, P + n + 11
    k2 = mx.concatenate([mx.random.normal((1, KH, T, D)), mx.pad(row_k, [(0, 0), (0, 0), (pad, 0), (0, 0)])])
    v2 = mx.concatenate([mx.random.normal((1, KH, T, D)), mx.pad(row_v, [(0, 0), (0, 0), (pad, 0), (0, 0)])])
    q2 = mx.concatenate([mx.random.normal((1, H, n, D)), q])
    cols, pos = mx.arange(T)[None, :], mx.arange(n)[:, None] + (T - n)
    mask = mx.stack([cols <= pos, (cols <= pos) & (cols >= pad)])[:, None]
    padded = np.array(nat.attention(q2, k2, v2, 0.125, mask))[1:]
    assert np.array_equal(whole, padded)
    # The prefix held once (the scheduler's shared-prefix prefill: the mask covers the row's own keys).
    own_mask = (mx.arange(n)[None, :] <= mx.arange(n)[:, None])[None, None]
    shared = np.array(nat.attention(q, own_k, own_v, 0.125, own_mask, shared_keys=sk, shared_values=sv))
    assert np.array_equal(whole, shared)
    _close(whole, SDPA(q, row_k, row_v, scale=0.125, mask="causal"))


def test_prefill_group_attention_matches_mlx_with_and_without_a_shared_prefix(nat):
    """The scheduler's grouped prefill: rows with different cached prefixes and chunk lengths, padded
    (kv_cache.prefill_layout's mask); and rows continuing one prefix held once (its mask covers the
    chunk only)."""
    from parallm_engine.kv.kv_cache import prefill_layout

    mx.random.seed(11)
    H, KH, D = 9, 3, 64
    _, mask, P, L = prefill_layout([12, 0, 7], [5, 9, 1])
    B, T = 3, P + L
    q = mx.random.normal((B, H, L, D))
    k, v = mx.random.normal((B, KH, T, D)), mx.random.normal((B, KH, T, D))
    _close(nat.attention(q, k, v, 0.125, mask), SDPA(q, k, v, scale=0.125, mask=mask))

    _, mask, P, L = prefill_layout([20, 20, 20], [4, 11, 7])
    sk, sv = mx.random.normal((1, KH, P, D)), mx.random.normal((1, KH, P, D))
    q = mx.random.normal((B, H, L, D))
    ck, cv = mx.random.normal((B, KH, L, D)), mx.random.normal((B, KH, L, D))
    chunk_mask = mask[..., P:]
    got = nat.attention(q, ck, cv, 0.125, chunk_mask, shared_keys=sk, shared_values=sv)
    want = cpu_kernels.cascade_attention(q, ck, cv, sk, sv, 0.125, chunk_mask)
    _close(got, want)
    full_k = mx.concatenate([mx.broadcast_to(sk, (B, KH, P, D)), ck], axis=2)
    full_v = mx.concatenate([mx.broadcast_to(sv, (B, KH, P, D)), cv], axis=2)
    want = SDPA(q, full_k, full_v, scale=0.125, mask=mask)
    for i, n in enumerate([4, 11, 7]):  # real queries (a padding query sees the prefix here, itself there)
        _close(got[i, :, L - n :], want[i, :, L - n :])


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 12), extra=st.integers(0, 20), rep=st.sampled_from([1, 2, 3, 4, 8]),
       seed=st.integers(0, 10_000), data=st.data())
def test_prefill_attention_property(nat, L, extra, rep, seed, data):
    """Any boolean (B or 1, 1, L or 1, T) mask that leaves each query at least one key."""
    T = L + extra
    B = data.draw(st.integers(1, 3))
    mb = data.draw(st.sampled_from([1, B]))
    ml = data.draw(st.sampled_from([1, L]))
    bits = np.array(data.draw(st.lists(st.booleans(), min_size=mb * ml * T, max_size=mb * ml * T)))
    bits = bits.reshape(mb, 1, ml, T)
    bits[..., -1] = True  # every query sees at least the last key
    mask = mx.array(bits)
    mx.random.seed(seed)
    KH, D = 2, 32
    q = mx.random.normal((B, KH * rep, L, D))
    k, v = mx.random.normal((B, KH, T, D)) * 3, mx.random.normal((B, KH, T, D))
    _close(nat.attention(q, k, v, 0.2, mask), SDPA(q, k, v, scale=0.2, mask=mask), tol=5e-5)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 5), L=st.integers(1, 5), T=st.integers(1, 40), D=st.sampled_from([64, 40]),
       shared=st.integers(0, 9), seed=st.integers(0, 10_000))
def test_paged_attention_reads_the_pool_through_the_table_with_the_same_bits(nat, B, L, T, D, shared, seed):
    """Keys and values in a page pool read through a slot table (kv_pages) give exactly the bits of the
    same keys gathered into per-row arrays: decode and verification widths, left padding, a shared prefix."""
    rng = np.random.default_rng(seed)
    KH, H, slots = 2, 4, 256
    pool_k = mx.array(rng.standard_normal((1, KH, slots, D)).astype(np.float32))
    pool_v = mx.array(rng.standard_normal((1, KH, slots, D)).astype(np.float32))
    lengths = [int(x) for x in rng.integers(L, T + L + 1, size=B)]
    W = max(lengths)
    table = np.zeros((B, W), dtype=np.int32)
    for b, n in enumerate(lengths):
        table[b, W - n :] = rng.choice(np.arange(1, slots), size=n, replace=False)
    pads = mx.array([W - n for n in lengths])
    mask = create_causal_mask(L, offset=W - L, left_padding=pads)
    q = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32))
    sk = sv = None
    if shared:
        sk = mx.array(rng.standard_normal((1, KH, shared, D)).astype(np.float32))
        sv = mx.array(rng.standard_normal((1, KH, shared, D)).astype(np.float32))
    t = mx.array(table)
    dense_k = pool_k[0][:, t].transpose(1, 0, 2, 3)
    dense_v = pool_v[0][:, t].transpose(1, 0, 2, 3)
    want = nat.attention(q, dense_k, dense_v, 0.125, mask, False, sk, sv)
    got = nat.attention(q, pool_k, pool_v, 0.125, mask, False, sk, sv, None, t)
    assert mx.array_equal(got, want)
    if sk is None:
        _close(got, SDPA(q, dense_k, dense_v, scale=0.125, mask=mask))
    with pytest.raises(ValueError):  # a table for the wrong number of rows
        nat.attention(q, pool_k, pool_v, 0.125, mask, False, None, None, None, mx.zeros((B + 1, W), dtype=mx.int32))


@pytest.mark.parametrize("n", [1, 3])
def test_paged_write_puts_each_row_position_at_its_slot(nat, n):
    """The new keys (B, KH, n, D) land at their slots of the head-major pool (KH, S, D), whether or not
    the pool's buffer can be reused; nothing else changes."""
    rng = np.random.default_rng(n)
    B, KH, S, D = 4, 3, 64, 16
    pool = mx.array(rng.standard_normal((KH, S, D)).astype(np.float32))
    rows = mx.array(rng.standard_normal((B, KH, n, D)).astype(np.float32))
    slots = rng.choice(np.arange(1, S), size=B * n, replace=False).astype(np.int32)
    want = np.array(pool).copy()
    want[:, slots] = np.array(rows).transpose(1, 0, 2, 3).reshape(KH, B * n, D)
    kept = pool  # another reference: the kernel must copy, not write the caller's array
    got = nat.paged_write(pool, rows, mx.array(slots))
    np.testing.assert_array_equal(np.array(got), want)
    assert not np.array_equal(np.array(kept), want)
    strided = mx.array(rng.standard_normal((B, n, KH, D)).astype(np.float32)).swapaxes(1, 2)  # a view
    want[:, slots] = np.array(strided).transpose(1, 0, 2, 3).reshape(KH, B * n, D)
    np.testing.assert_array_equal(np.array(nat.paged_write(got, strided, mx.array(slots))), want)
    with pytest.raises(ValueError):
        nat.paged_write(pool, rows, mx.array(slots[:-1]))


@pytest.mark.parametrize("D", [16, 20])
def test_fully_masked_row_gives_zeros_not_nan(nat, D):
    q = mx.random.normal((2, 2, 3, D))
    k = v = mx.random.normal((2, 2, 5, D))
    mask = mx.array([[True] * 5, [False] * 5]).reshape(2, 1, 1, 5)
    out = np.array(nat.attention(q, k, v, 0.25, mask))
    assert not np.isnan(out).any()
    assert (out[1] == 0).all()


@pytest.mark.parametrize("D", [16, 20])
def test_a_position_that_sees_none_of_its_own_columns_is_padding(nat, D):
    """A ragged verify step's rectangle cells no row fills see none of their own columns (every real
    query sees its own key): zeros, not computed, even where the row continues a shared prefix; the other
    positions keep their bits."""
    rng = np.random.default_rng(0)
    B, H, KH, L, T, P = 2, 4, 2, 3, 6, 5
    q = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((B, KH, T, D)).astype(np.float32)) for _ in range(2))
    sk, sv = (mx.array(rng.standard_normal((1, KH, P, D)).astype(np.float32)) for _ in range(2))
    real = np.array(create_causal_mask(L, offset=T - L))[None, None].repeat(B, 0)  # (B, 1, L, T)
    padded = real.copy()
    padded[0, 0, :2] = False  # row 0 has one position: its first two cells are padding
    got = np.array(nat.attention(q, k, v, 0.25, mx.array(padded), False, sk, sv, None))
    want = np.array(nat.attention(q, k, v, 0.25, mx.array(real), False, sk, sv, None))
    assert (got[0, :, :2] == 0).all()
    np.testing.assert_array_equal(got[0, :, 2:], want[0, :, 2:])
    np.testing.assert_array_equal(got[1], want[1])


def test_attention_rejects_what_it_does_not_handle(nat):
    q = mx.zeros((1, 4, 2, 16))
    kv = mx.zeros((1, 2, 3, 16))
    with pytest.raises(ValueError, match="float32"):
        nat.attention(q.astype(mx.float16), kv, kv, 0.25)
    with pytest.raises(ValueError, match="every head"):
        nat.attention(q, kv, kv, 0.25, mx.ones((1, 4, 2, 3), mx.bool_))
    with pytest.raises(ValueError, match="inconsistent"):
        nat.attention(mx.zeros((1, 3, 1, 16)), kv, kv, 0.25)
    with pytest.raises(ValueError, match="causal"):
        nat.attention(q, kv, kv, 0.25, mx.ones((1, 1, 2, 3), mx.bool_), True)
    with pytest.raises(ValueError, match="boolean"):
        nat.attention(q, kv, kv, 0.25, mx.zeros((1, 1, 2, 3)))
    # The engine's hook sends those cases to the pure-MLX kernel instead.
    per_head = mx.ones((1, 4, 2, 3), mx.bool_)
    assert cpu_kernels._native_attention(q, kv, kv, 0.25, per_head) is None
    assert cpu_kernels._native_attention(q, kv, kv, 0.25, mx.zeros((1, 1, 2, 3))) is None  # additive
    assert cpu_kernels._native_attention(q.astype(mx.float16), kv, kv, 0.25, None) is None
    assert cpu_kernels._native_attention(mx.zeros((1, 4, 5, 16)), kv, kv, 0.25, "causal") is None  # L > T


def _ref_linear(x, w, b=None):
    y = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T
    return y if b is None else y + np.asarray(b, dtype=np.float64)


@pytest.mark.parametrize("M,K,N", [(1, 576, 576), (3, 576, 192), (4, 20, 13), (5, 16, 6), (32, 576, 1536),
                                   (37, 1536, 7), (64, 64, 100), (130, 33, 61)])
def test_linear_matches_matmul(nat, M, K, N):
    rng = np.random.default_rng(M * 1000 + N)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    b = mx.array(rng.standard_normal((N,)).astype(np.float32))
    tol = 1e-5 * np.sqrt(K)
    np.testing.assert_allclose(np.array(nat.linear(x, w)), _ref_linear(x, w), atol=tol, rtol=1e-5)
    np.testing.assert_allclose(np.array(nat.linear(x, w, b)), _ref_linear(x, w, b), atol=tol, rtol=1e-5)
    # Leading axes are kept: (2, M, K) -> (2, M, N).
    x3 = mx.stack([x, x * 2])
    np.testing.assert_allclose(np.array(nat.linear(x3, w)), np.stack([_ref_linear(x, w), _ref_linear(x * 2, w)]),
                               atol=2 * tol, rtol=1e-5)


def test_linear_reads_views_in_place_or_gathered(nat):
    """Inputs are views whose strides are known only at evaluation: a transposed x, a strided weight."""
    rng = np.random.default_rng(5)
    xt = mx.array(rng.standard_normal((48, 7)).astype(np.float32)).T  # (7, 48), not row-contiguous
    big = mx.array(rng.standard_normal((20, 96)).astype(np.float32))
    w = big[::2, ::2]  # (10, 48) strided view
    np.testing.assert_allclose(np.array(nat.linear(xt, w)), _ref_linear(xt, w), atol=1e-4, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(M=st.integers(1, 70), row=st.data(), K=st.sampled_from([16, 40, 576]), N=st.integers(1, 40),
       seed=st.integers(0, 1000))
def test_linear_row_is_bitwise_independent_of_the_batch(nat, M, row, K, N, seed):
    """A row's output has the same bits computed alone or at any position in a batch of any size
    (what keeps batched greedy decoding equal to sequential once the projections are native)."""
    i = row.draw(st.integers(0, M - 1))
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    b = mx.array(rng.standard_normal((N,)).astype(np.float32))
    batched = np.array(nat.linear(x, w, b))[i]
    alone = np.array(nat.linear(x[i : i + 1], w, b))[0]
    assert np.array_equal(batched, alone)


def test_linear_rejects_bad_input(nat):
    x, w = mx.zeros((2, 8)), mx.zeros((3, 8))
    with pytest.raises(ValueError, match="last axis"):
        nat.linear(x, mx.zeros((3, 9)))
    with pytest.raises(ValueError, match="float32"):
        nat.linear(x.astype(mx.float16), w)
    with pytest.raises(ValueError, match="bias"):
        nat.linear(x, w, mx.zeros((4,)))
    with pytest.raises(ValueError, match="weight"):
        nat.linear(x, mx.zeros((8,)))
    with cpu_kernels.enabled():
        assert cpu_kernels.linear_native(x.astype(mx.bfloat16), w) is None  # the hook keeps MLX's matmul


def test_rms_norm_matches_mlx(nat):
    x = mx.random.normal((3, 5, 576)) * 4
    w = mx.random.normal((576,))
    _close(nat.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5), tol=1e-5)
    _close(nat.rms_norm(x, None, 1e-6), mx.fast.rms_norm(x, None, 1e-6), tol=1e-5)
    xt = mx.random.normal((64, 10)).T  # a transposed view
    _close(nat.rms_norm(xt, None, 1e-5), mx.fast.rms_norm(xt, None, 1e-5), tol=1e-5)
    zeros = np.array(nat.rms_norm(mx.zeros((2, 8)), mx.ones((8,)), 1e-5))
    assert (zeros == 0).all()
    with pytest.raises(ValueError, match="weight"):
        nat.rms_norm(x, mx.ones((5,)), 1e-5)


def test_switched_modules_keep_the_parameters_and_apply_only_inside_enabled(nat):
    """install() swaps the class of plain float32 Linear / RMSNorm modules: same objects, same parameter
    tree; MLX's own ops outside ``enabled``, the native kernels (close to them) inside."""
    from mlx.utils import tree_flatten

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(32)
            self.proj = nn.Linear(32, 48)
            self.out = nn.Linear(48, 16, bias=False)
            self.q = nn.QuantizedLinear(64, 64, bias=False)  # not float32 weights: left alone

    block = Block()
    before = [k for k, _ in tree_flatten(block.parameters())]
    assert cpu_kernels._install_native_modules(block)
    # The native linear is used where it is tuned (AVX-512, AVX2); elsewhere Linear keeps MLX's matmul.
    linear = cpu_kernels._SwitchedLinear if cpu_kernels.native_linear_rows() else nn.Linear
    assert type(block.proj) is linear and isinstance(block.proj, nn.Linear)
    assert type(block.norm) is cpu_kernels._SwitchedRMSNorm
    assert type(block.q) is nn.QuantizedLinear
    assert [k for k, _ in tree_flatten(block.parameters())] == before
    x = mx.random.normal((3, 32))
    plain = block.out(block.proj(block.norm(x)))
    with cpu_kernels.enabled():
        fast = block.out(block.proj(block.norm(x)))
    _close(fast, plain, tol=1e-4)
    big = mx.random.normal((max(cpu_kernels.native_linear_rows(), 1) + 1, 32))  # a prefill chunk keeps MLX's GEMM
    with cpu_kernels.enabled():
        _close(block.proj(big), big @ block.proj.weight.T + block.proj.bias, tol=1e-5)


def test_swiglu_matches_silu(nat):
    gate = mx.concatenate([mx.random.normal((3000,)) * 6, mx.array([-200.0, -90.0, 0.0, 90.0, 200.0])])
    x = mx.random.normal(gate.shape)
    out = nat.swiglu(gate, x)
    _close(out, nn.silu(gate) * x)
    assert not np.isnan(np.array(out)).any()
    with pytest.raises(ValueError):
        nat.swiglu(gate, x[:10])


@pytest.mark.parametrize("dims,D,traditional", [(64, 64, False), (32, 64, False), (16, 16, True)])
def test_rope_rows_matches_the_table_and_mlx(nat, dims, D, traditional):
    table = cpu_kernels.RoPETable(dims, 10000.0, 1.0, traditional, max_positions=300)
    B, H = 4, 3
    x = mx.random.normal((B, H, 1, D))
    pos = mx.array([0, 5, 299, 1000])  # the last is past the table: computed directly
    out = nat.rope_rows(x, pos, table.cos, table.sin, dims, traditional, 10000.0, 1.0)
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0)
    _close(out, rope(x, offset=pos), tol=2e-4)  # mx.fast.rope computes its angles in float32
    _close(out[:3], table(x[:3], pos[:3]), tol=1e-6)


@pytest.mark.parametrize("dims,D,traditional", [(64, 64, False), (32, 64, False), (16, 16, True)])
def test_rope_rows_of_several_positions_are_bitwise_the_table(nat, dims, D, traditional, monkeypatch):
    """Speculative verification rotates a few positions per row (position offsets[b] + l) in one op: the
    same bits as the table's MLX ops (prefill), so a verified position's keys equal decode's."""
    table = cpu_kernels.RoPETable(dims, 10000.0, 1.0, traditional, max_positions=600)
    x = mx.random.normal((3, 4, 7, D))
    pos = mx.array([0, 17, 400], dtype=mx.int32)
    out = nat.rope_rows(x, pos, table.cos, table.sin, dims, traditional, 10000.0, 1.0)
    out_int = nat.rope_rows(x, mx.full((3,), 5, mx.int32), table.cos, table.sin, dims, traditional, 10000.0, 1.0)
    monkeypatch.setattr(cpu_kernels, "_native", lambda: None)  # the table's pure-MLX path
    assert np.array_equal(np.array(out), np.array(table(x, pos)))
    assert np.array_equal(np.array(out_int), np.array(table(x, 5)))
    # One position at a time (decode) gives the same bits as the block.
    monkeypatch.undo()
    alone = nat.rope_rows(x[:, :, 3:4], pos + 3, table.cos, table.sin, dims, traditional, 10000.0, 1.0)
    assert np.array_equal(np.array(alone), np.array(out[:, :, 3:4]))


def test_linear_is_tuned_for_this_cpu_or_off(nat):
    """The native linear runs where it has tiles tuned for the registers (AVX-512: 64 rows, AVX2: 16);
    a wider input keeps MLX's GEMM, or, from GEMM_SPLIT_MIN_ROWS rows where the BLAS runs one thread per
    caller (MKL sequential, set once an engine configured it in this process), the GEMM split over the
    cores: never the tuned linear."""
    rows = cpu_kernels.native_linear_rows()
    assert rows == {16: cpu_kernels.NATIVE_LINEAR_ROWS, 8: cpu_kernels.NATIVE_LINEAR_ROWS_AVX2}.get(nat.linear_lanes(), 0)
    w = mx.random.normal((40, 24))
    with cpu_kernels.enabled():
        if rows:
            x = mx.random.normal((rows, 24))
            assert np.array_equal(np.array(cpu_kernels.linear_native(x, w)), np.array(nat.linear(x, w, None)))
        wide = mx.random.normal((rows + 1, 24))
        split = cpu_kernels._gemm_split(nat, wide, w, None)
        out = cpu_kernels.linear_native(wide, w)
        if split is None:
            assert out is None
        else:
            assert rows + 1 >= cpu_kernels.GEMM_SPLIT_MIN_ROWS
            assert np.array_equal(np.array(out), np.array(split))


def test_build_is_cached_and_can_be_turned_off(nat):
    assert native.build() == native.build()
    assert native.status()["available"]
    env = dict(os.environ, PARALLM_NATIVE="0")
    code = "from parallm_engine import native; print(native.status())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "'available': False" in out.stdout and "PARALLM_NATIVE=0" in out.stdout, out.stderr


def test_engine_decode_uses_native_kernels(tiny_engine):
    assert tiny_engine._scheduler.native_kernels


@pytest.mark.parametrize("M,K,N", [(64, 576, 1536), (100, 96, 40), (3, 16, 8)])
def test_gemm_split_matches_matmul(nat, M, K, N):
    """The prefill GEMM on every core (output columns over the kernels' threads, each a single-threaded
    BLAS sgemm), with and without a bias, through the linear hook for a prefill's many rows."""
    if not nat.has_sgemm():
        pytest.skip("no cblas_sgemm in this process")
    mx.random.seed(M + K + N)
    x, w, b = mx.random.normal((2, M, K)), mx.random.normal((N, K)), mx.random.normal((N,))
    _close(nat.gemm_split(x, w), x @ w.T, tol=1e-4)
    _close(nat.gemm_split(x, w, b), x @ w.T + b, tol=1e-4)
    with cpu_kernels.enabled(True):
        y = cpu_kernels.linear_native(x, w, b)
    if cpu_kernels._gemm_split_available(nat) and 2 * M >= cpu_kernels.GEMM_SPLIT_MIN_ROWS:
        assert y is not None
        _close(y, x @ w.T + b, tol=1e-4)
    with pytest.raises(ValueError, match="last axis"):
        nat.gemm_split(x, mx.random.normal((N, K + 1)))


def test_linear_kernels_with_an_empty_inner_dimension_give_the_bias(nat):
    """K = 0: an empty sum, so the bias (or zeros); gemm_split must not hand the BLAS lda = 0."""
    x, b = mx.zeros((3, 0)), mx.array([1.0, 2.0])
    want = mx.broadcast_to(b, (3, 2))
    for w in (mx.zeros((2, 0)), mx.zeros((2, 0), dtype=mx.bfloat16)):
        assert mx.array_equal(nat.linear(x, w, b), want).item()
        assert mx.array_equal(nat.linear(x, w), mx.zeros((3, 2))).item()
        if nat.has_sgemm():
            assert mx.array_equal(nat.gemm_split(x, w, b), want).item()
    if nat.has_bf16_dot():
        assert mx.array_equal(nat.linear_bf16_packed(x, mx.zeros((1, 0, 64, 2), dtype=mx.bfloat16), 2, b), want).item()
