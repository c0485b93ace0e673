"""The CPU fast paths: the engine's own attention/SwiGLU kernels match MLX's, and parallel decode
lanes change nothing but speed (same tokens as one lane, and as each request alone)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from parallm_engine import Engine

from parallm_engine.runner import cpu_kernels
from parallm_engine.kv.paged_prefill import PrefillRow
from parallm_engine.kv.decode_batch import LANE_FILL_ROWS, DecodeBatch
from parallm_engine.runner.model_runner import split_balanced


def _close(a: mx.array, b: mx.array, tol: float = 2e-5) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=tol, rtol=tol)


@pytest.mark.parametrize("B,H,KH,L,T", [(3, 9, 3, 1, 37), (2, 4, 4, 5, 5), (2, 8, 2, 7, 19), (1, 6, 1, 16, 16)])
def test_attention_matches_mlx_sdpa(B, H, KH, L, T):
    mx.random.seed(B * 100 + T)
    q = mx.random.normal((B, H, L, 16))
    k = mx.random.normal((B, KH, T, 16)) * 2
    v = mx.random.normal((B, KH, T, 16))
    ref = mx.fast.scaled_dot_product_attention
    _close(cpu_kernels.attention(q, k, v, 0.25), ref(q, k, v, scale=0.25))
    if L == T:
        _close(cpu_kernels.attention(q, k, v, 0.25, "causal"), ref(q, k, v, scale=0.25, mask="causal"))
    # Left-padded rows, as the decode batch builds them (boolean, broadcast over heads).
    lp = mx.array([i % max(T - L, 1) for i in range(B)])
    mask = create_causal_mask(L, offset=T - L, left_padding=lp)
    _close(cpu_kernels.attention(q, k, v, 0.25, mask), ref(q, k, v, scale=0.25, mask=mask))
    additive = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    _close(cpu_kernels.attention(q, k, v, 0.25, additive), ref(q, k, v, scale=0.25, mask=additive))
    # A per-head mask.
    per_head = mx.random.uniform(shape=(B, H, L, T)) > 0.3
    per_head = per_head | (mx.arange(T) == 0)  # every query sees at least one key
    _close(cpu_kernels.attention(q, k, v, 0.25, per_head), ref(q, k, v, scale=0.25, mask=per_head))


def test_swiglu_matches_silu_including_extremes():
    gate = mx.concatenate([mx.random.normal((1000,)) * 6, mx.array([-200.0, -90.0, 0.0, 90.0, 200.0])])
    x = mx.random.normal(gate.shape)
    _close(cpu_kernels.swiglu(gate, x), nn.silu(gate) * x)
    assert not np.isnan(np.array(cpu_kernels.swiglu(gate, x))).any()


def test_kernels_apply_only_inside_enabled(tiny_engine, tiny_model_dir):
    """The engine binds its attention to its own model's module instances only: mlx-lm's module keeps
    its functions, a second plain mlx-lm model in the process gives mlx-lm's exact logits, and even the
    engine's model runs mlx-lm's functions outside ``enabled`` (the bench's baselines use it)."""
    from mlx_lm.models import base, llama
    from mlx_lm.utils import load as mlx_load

    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention  # nothing patched
    attn = tiny_engine.model.model.layers[0].self_attn
    assert getattr(type(attn), "_parallm_hooked", False) and isinstance(attn, llama.Attention)
    plain, _ = mlx_load(str(tiny_model_dir))
    assert type(plain.model.layers[0].self_attn) is llama.Attention
    assert not cpu_kernels.handles_shared_prefix(plain)
    # The engine's model is float32 on the CPU; compare the plain one in the same dtype.
    plain.set_dtype(mx.float32)
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    reference = llama.Model(plain.args)
    reference.update(plain.parameters())
    assert mx.array_equal(plain(x), reference(x)).item()  # a plain model is mlx-lm's, bit for bit
    assert not cpu_kernels.is_enabled()
    calls = []
    orig = cpu_kernels.attention
    try:
        cpu_kernels.attention = lambda *a, **k: calls.append(1) or orig(*a, **k)
        q = mx.random.normal((1, 4, 2, 16))
        kv = mx.random.normal((1, 2, 3, 16))
        additive = mx.zeros((1, 1, 2, 3))  # an additive mask: the pure-MLX kernel (the native one takes bool)
        hooked_sdpa = type(attn).__call__.__globals__["scaled_dot_product_attention"]
        hooked_sdpa(q, kv, kv, cache=None, scale=0.25, mask=additive)
        assert calls == []
        with cpu_kernels.enabled():
            hooked_sdpa(q, kv, kv, cache=None, scale=0.25, mask=additive)
            plain(x)  # a plain model never reaches the engine's kernels, even inside the switch
        assert calls == [1]
    finally:
        cpu_kernels.attention = orig


def test_split_balanced_keeps_order_and_balances():
    items = list("abcdefg")
    weights = [50, 10, 10, 10, 10, 10, 10]
    shares = split_balanced(items, weights, 2)
    assert sorted(x for s in shares for x in s) == items
    assert all(s == sorted(s) for s in shares)
    loads = [sum(weights[items.index(x)] for x in s) for s in shares]
    assert max(loads) - min(loads) <= 10
    assert split_balanced(["a"], [5], 4) == [["a"]]
    assert split_balanced(items, weights, 1) == [items]
    assert split_balanced([], [], 2) == []


def test_decode_batch_fills_a_lane_then_places_rows_on_the_least_loaded():
    class Seq:
        cache = None

    def join(seqs):
        """Open each sequence's row where the batch places it (as a prompt's prefill does), then join."""
        kv = mx.zeros((1, 2, 3, 4))
        for s in seqs:
            lane = batch.place(s, 0)
            s.cache = PrefillRow(lane, lane.kv.open_row(np.zeros(0, dtype=np.int32), [(kv, kv)] * 2), 0)
        batch.join(seqs)

    batch = DecodeBatch(n_layers=2, n_lanes=2)
    assert batch.fill_rows == LANE_FILL_ROWS >= 16  # a small batch decodes on one lane
    small = [Seq() for _ in range(3)]
    join(small)
    assert [len(lane.seqs) for lane in batch.lanes] == [3, 0]
    batch.drop({id(s) for s in small})
    batch.fill_rows = 2
    seqs = [Seq() for _ in range(5)]
    join(seqs[:3])  # the first lane up to 2 rows, then the least loaded
    assert [len(lane.seqs) for lane in batch.lanes] == [2, 1]
    batch.drop({id(seqs[0]), id(seqs[1])})
    assert [len(lane.seqs) for lane in batch.lanes] == [0, 1]
    join(seqs[3:])
    assert [len(lane.seqs) for lane in batch.lanes] == [2, 1]
    # Row order is lane by lane.
    assert [id(s) for s in batch.running] == [id(seqs[3]), id(seqs[4]), id(seqs[2])]
    assert batch.nbytes() > 0
    batch.drop({id(s) for s in seqs})
    assert len(batch) == 0 and batch.nbytes() == 0


def _tokens(engine, prompts, **kw):
    return [r.token_ids for r in engine.generate(prompts, temperature=0, **kw)]


@pytest.fixture(scope="module")
def lane_engines(tiny_model_dir):
    one = Engine(str(tiny_model_dir), decode_lanes=1, prefill_chunk=32)
    three = Engine(str(tiny_model_dir), decode_lanes=3, prefill_chunk=32)
    three._scheduler.batch.fill_rows = 1  # a few rows over all three lanes
    yield one, three
    one.shutdown()
    three.shutdown()


def test_lanes_give_the_same_greedy_tokens(lane_engines, tiny_engine):
    """Three lanes (uneven shares, rows leaving at different steps) equal one lane, token for token,
    and each equals its request run alone."""
    one, three = lane_engines
    prompts = [three.encode(f"Item {i}: " + "word " * (3 + 5 * i)) for i in range(7)]
    lengths = [4 + 3 * i for i in range(7)]

    def run(engine):
        handles = [engine.submit(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(prompts, lengths)]
        return [engine._collect(h).token_ids for h in handles]

    together_three, together_one = run(three), run(one)
    alone = [_tokens(one, [p], max_tokens=n, ignore_eos=True)[0] for p, n in zip(prompts, lengths)]
    assert together_three == together_one == alone
    assert three.stats()["running"] == 0 and three._scheduler.batch_kv_bytes() == 0


def test_shared_prefix_longer_than_a_chunk_is_prefilled_in_groups(lane_engines):
    """After the first request puts a shared prefix longer than one prefill chunk in the radix tree,
    the others (short suffixes) are prefilled together, not one forward each."""
    one, _ = lane_engines
    prefix = one.encode("Shared system prompt with tools and rules. " * 6)
    assert len(prefix) > 32
    prompts = [prefix + one.encode(f" Question {i}?") for i in range(8)]
    first = one.generate([prompts[0]], max_tokens=2, temperature=0)[0]
    before = one.stats()
    rest = one.generate(prompts[1:], max_tokens=2, temperature=0)
    after = one.stats()
    assert all(r.usage.cached_tokens >= len(prefix) - 1 for r in rest)
    assert after["prefill_forwards"] - before["prefill_forwards"] <= 3
    assert first.usage.cached_tokens == 0


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_table_matches_mlx_rope(traditional):
    rope = nn.RoPE(16, traditional=traditional, base=10000.0, scale=0.5)
    table = cpu_kernels.RoPETable(16, 10000.0, 0.5, traditional, max_positions=4096)
    x = mx.random.normal((3, 4, 5, 24))  # dims < head size: the tail passes through
    _close(table(x, 0), rope(x, offset=0), tol=1e-4)
    _close(table(x, 3000), rope(x, offset=3000), tol=1e-3)
    offsets = mx.array([0, 7, 1000])  # per-row offsets, as the decode batch passes them
    _close(table(x, offsets), rope(x, offset=offsets), tol=1e-3)


def test_install_is_idempotent_and_keeps_the_parameter_tree(tiny_model_dir):
    from mlx.utils import tree_flatten

    from parallm_engine.models.loader import load_model

    model = load_model(str(tiny_model_dir))[0]
    before = [k for k, _ in tree_flatten(model.parameters())]
    assert cpu_kernels.install(model, 512)
    assert cpu_kernels.install(model, 512)  # a second engine on the same module still gets them
    assert [k for k, _ in tree_flatten(model.parameters())] == before
    x = mx.array([[1, 2, 3, 4]])
    ref = model(x)
    with cpu_kernels.enabled():
        fast = model(x)
    _close(fast, ref, tol=1e-3)


def test_install_leaves_a_module_own_variants_alone():
    """A model module that defines its own attention / SwiGLU (not mlx-lm's shared ones) keeps them."""
    import sys
    import types

    import mlx.nn as nn

    mod = types.ModuleType("mlx_lm.models._parallm_fake")

    def own_swiglu(gate, x, alpha=1.702):  # a model's own variant, not mlx-lm's
        return gate * x * alpha

    mod.swiglu = own_swiglu
    mod.scaled_dot_product_attention = lambda *a, **k: None
    mod.nn = nn
    exec("class Block(nn.Module):\n    def __call__(self, x):\n        return swiglu(x, x)\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        block = mod.Block()
        assert not cpu_kernels.install(block, None)
        assert type(block) is mod.Block and mod.swiglu is own_swiglu
    finally:
        del sys.modules[mod.__name__]


@pytest.mark.parametrize("B,H,KH,L,P,T", [(3, 9, 3, 1, 40, 7), (4, 4, 2, 1, 5, 1), (2, 8, 2, 6, 11, 6), (1, 6, 1, 3, 64, 9)])
def test_cascade_attention_equals_attention_over_the_concatenation(B, H, KH, L, P, T):
    """A prefix held once equals every row holding its own copy, for rows that continue it and rows
    that do not (their prefix columns masked out), with and without a mask on the rows' own keys."""
    mx.random.seed(P * 10 + T)
    q = mx.random.normal((B, H, L, 16))
    pk, pv = mx.random.normal((1, KH, P, 16)) * 2, mx.random.normal((1, KH, P, 16))
    k, v = mx.random.normal((B, KH, T, 16)) * 2, mx.random.normal((B, KH, T, 16))
    full_k = mx.concatenate([mx.broadcast_to(pk, (B, KH, P, 16)), k], axis=2)
    full_v = mx.concatenate([mx.broadcast_to(pv, (B, KH, P, 16)), v], axis=2)
    # Rows' own keys left-padded as the decode batch pads them (every query keeps its own key);
    # causal within them when L > 1.
    lp = mx.array([i % (T - L + 1) for i in range(B)])
    own_mask = create_causal_mask(L, offset=T - L, left_padding=lp)  # (B, 1, L, T)
    uses = mx.array([i % 2 == 0 for i in range(B)]) if B > 1 else None
    for shared_mask in (None, uses):
        prefix_cols = mx.ones((B, 1, L, P), dtype=mx.bool_)
        if shared_mask is not None:
            prefix_cols = prefix_cols & shared_mask.reshape(B, 1, 1, 1)
        full_mask = mx.concatenate([prefix_cols, own_mask], axis=-1)
        got = cpu_kernels.cascade_attention(q, k, v, pk, pv, 0.25, own_mask, shared_mask)
        _close(got, cpu_kernels.attention(q, full_k, full_v, 0.25, full_mask), tol=5e-5)
        _close(got, mx.fast.scaled_dot_product_attention(q, full_k, full_v, scale=0.25, mask=full_mask), tol=5e-5)
