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

from parallm_engine import cpu_kernels, native

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
    _close(nat.decode_attention(q, k, v, scale), SDPA(q, k, v, scale=scale))
    mask = _left_pad_mask([0, 3, 10, 36, 1], T)
    _close(nat.decode_attention(q, k, v, scale, mask), SDPA(q, k, v, scale=scale, mask=mask))


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
    got = nat.decode_attention(q, k, v, D**-0.5, mask, sk, sv)
    _close(got, SDPA(q, full_k, full_v, scale=D**-0.5, mask=full_mask))
    # Rows 1 and 3 do not continue the prefix: they attend to their own columns only.
    uses = mx.array([True, False, True, False])
    got = nat.decode_attention(q, k, v, D**-0.5, mask, sk, sv, uses)
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
    alone = nat.decode_attention(q, row_k, row_v, 0.125)

    # In a batch of 3, padded on the left by 9 columns, next to unrelated rows.
    pad = 9
    T = P + n + pad
    others_k, others_v = mx.random.normal((3, KH, T, D)), mx.random.normal((3, KH, T, D))
    zeros = mx.zeros((1, KH, pad, D))
    batch_k = mx.concatenate([others_k[:1], mx.concatenate([zeros, row_k], axis=2), others_k[2:]])
    batch_v = mx.concatenate([others_v[:1], mx.concatenate([zeros, row_v], axis=2), others_v[2:]])
    qs = mx.concatenate([mx.random.normal((1, H, 1, D)), q, mx.random.normal((1, H, 1, D))])
    batched = nat.decode_attention(qs, batch_k, batch_v, 0.125, _left_pad_mask([0, pad, 4], T))[1:2]
    assert np.array_equal(np.array(alone), np.array(batched))

    # With the prefix held once: the row stores only its own columns.
    shared = nat.decode_attention(q, own_k, own_v, 0.125, None, sk, sv)
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
    _close(nat.decode_attention(q, k, v, 0.2, mask), SDPA(q, k, v, scale=0.2, mask=mask), tol=5e-5)


def test_fully_masked_row_gives_zeros_not_nan(nat):
    q = mx.random.normal((2, 2, 1, 16))
    k = v = mx.random.normal((2, 2, 5, 16))
    mask = mx.array([[True] * 5, [False] * 5]).reshape(2, 1, 1, 5)
    out = np.array(nat.decode_attention(q, k, v, 0.25, mask))
    assert not np.isnan(out).any()
    assert (out[1] == 0).all()


def test_decode_attention_rejects_what_it_does_not_handle(nat):
    q = mx.zeros((1, 4, 2, 16))
    kv = mx.zeros((1, 2, 3, 16))
    with pytest.raises(ValueError, match="one query position"):
        nat.decode_attention(q, kv, kv, 0.25)
    with pytest.raises(ValueError, match="float32"):
        nat.decode_attention(q[:, :, :1].astype(mx.float16), kv, kv, 0.25)
    with pytest.raises(ValueError, match="every head"):
        nat.decode_attention(q[:, :, :1], kv, kv, 0.25, mx.ones((1, 4, 1, 3), mx.bool_))
    with pytest.raises(ValueError, match="inconsistent"):
        nat.decode_attention(mx.zeros((1, 3, 1, 16)), kv, kv, 0.25)
    # The engine's hook sends those cases to the pure-MLX kernel instead.
    per_head = mx.ones((1, 4, 1, 3), mx.bool_)
    assert cpu_kernels._native_decode_attention(q[:, :, :1], kv, kv, 0.25, per_head) is None
    assert cpu_kernels._native_decode_attention(q, kv, kv, 0.25, None) is None


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


def test_build_is_cached_and_can_be_turned_off(nat):
    assert native.build() == native.build()
    assert native.status()["available"]
    env = dict(os.environ, PARALLM_NATIVE="0")
    code = "from parallm_engine import native; print(native.status())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "'available': False" in out.stdout and "PARALLM_NATIVE=0" in out.stdout, out.stderr


def test_engine_decode_uses_native_kernels(tiny_engine):
    assert tiny_engine._scheduler.native_kernels
