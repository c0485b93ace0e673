"""weights_dtype="bfloat16" on the CPU: bf16 weight storage, float32 math; and "bfloat16-matmul":
bf16 weights and matmul inputs, float32 sums (AVX512_BF16's vdpbf16ps where the CPU has it).

The native linear on bf16 weights is bitwise the float32 linear on the same weights widened (the
widening is exact); the AVX512_BF16 kernel computes bf16(x) @ w in float32 sums, a row's result
independent of its batch; the engine's logprobs on the default model stay within a stated bound of the
float32 engine's in both modes; and the engine's own invariants (batched == alone, cache hit == cold)
hold within each. Runs on both backends (cpu-native and PARALLM_BACKEND=cpu-mlx)."""

from __future__ import annotations

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
import mlx.core as mx

from parallm_engine import native
from parallm_engine.core.engine import Engine
from parallm_engine.errors import InvalidRequestError
from parallm_engine.runner.weights_dtype import resolve_weights_dtype

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at", "The three primary colors are"]
NEW_TOKENS = 24
# Measured on the default model (SmolLM2-135M, these prompts, 24 greedy tokens): mean |drift| of the
# chosen tokens' logprobs ~0.01, max ~0.04; the first divergence from fp32's greedy tokens came after
# 12+ tokens (a near-tie), 4 of 5 prompts identical throughout. The bounds leave room for BLAS
# and CPU differences.
MEAN_DRIFT_BOUND = 0.05
MAX_DRIFT_BOUND = 0.25
MIN_AGREED_PREFIX = 6  # every prompt's first greedy tokens equal fp32's
MIN_AGREEMENT = 0.6  # of all generated positions, before each prompt's first divergence
# "bfloat16-matmul" rounds every matmul input as well. Measured (same prompts): mean 0.0074, max 0.042,
# agreement 92/120 with the AVX512_BF16 kernel (" Water boils at" parts after 4 tokens, " 100" vs " 1000",
# a near-tie); 0.0092 / 0.053 / 120/120 through MLX ops. Same drift bounds, a shorter agreed prefix.
BOUNDS = {"bfloat16": (MEAN_DRIFT_BOUND, MAX_DRIFT_BOUND, MIN_AGREED_PREFIX, MIN_AGREEMENT),
          "bfloat16-matmul": (MEAN_DRIFT_BOUND, MAX_DRIFT_BOUND, 3, MIN_AGREEMENT)}


@pytest.fixture(scope="module", params=["bfloat16", "bfloat16-matmul"])
def bf16_engine(request):
    eng = Engine(weights_dtype=request.param, max_batch_size=16)
    yield eng
    eng.shutdown()




def _run(engine, prompts):
    return engine.generate(prompts, max_tokens=NEW_TOKENS, temperature=0, logprobs=True)


def test_native_linear_reads_bf16_weights_exactly():
    nat = native.load()
    if nat is None or not nat.linear_lanes():
        pytest.skip(f"native linear not in use here: {native.status()}")
    mx.random.seed(3)
    for M, K, N in [(1, 576, 40), (5, 77, 13), (16, 64, 19), (3, 8, 6)]:
        x = mx.random.normal((M, K))
        w = mx.random.normal((N, K)).astype(mx.bfloat16)
        b = mx.random.normal((N,))
        widened = w.astype(mx.float32)
        for bias in (None, b):
            assert mx.array_equal(nat.linear(x, w, bias), nat.linear(x, widened, bias)).item()
            ref = x @ widened.T + (0 if bias is None else bias)
            assert mx.allclose(nat.linear(x, w, bias), ref, atol=1e-4, rtol=1e-4).item()
            if nat.has_sgemm():  # prefill's path: weight rows widened into a scratch buffer, then the BLAS
                assert mx.allclose(nat.gemm_split(x, w, bias), ref, atol=1e-4, rtol=1e-4).item()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        nat.linear(mx.ones((1, 8)), mx.ones((4, 8), dtype=mx.float16))


def test_bf16_matmul_kernel_computes_bf16_inputs_in_float32_sums():
    """``linear_bf16_packed`` (AVX512_BF16) on the weight packed into 64-column panels: bf16(x) @ w.T
    (+ bias) with float32 sums, against the same math in MLX ops; every row the same bits alone as in any
    batch (decode and prefill row counts); the panels unpack to the weight exactly."""
    from parallm_engine.runner.weights_dtype import pack_panels, unpack_panels

    nat = native.load()
    if nat is None or not nat.has_bf16_dot():
        pytest.skip(f"no AVX512_BF16 kernel here: {native.status() if nat is None else 'CPU without avx512_bf16'}")
    mx.random.seed(5)
    for M, K, N in [(1, 576, 40), (37, 576, 1536), (5, 77, 13), (3, 8, 6), (70, 33, 7), (13, 64, 130)]:
        x = mx.random.normal((M, K))
        w = (mx.random.normal((N, K)) * 0.1).astype(mx.bfloat16)
        b = mx.random.normal((N,))
        packed = pack_panels(w)
        assert mx.array_equal(unpack_panels(packed, N, K), w).item()
        for bias in (None, b):
            ref = x.astype(mx.bfloat16).astype(mx.float32) @ w.astype(mx.float32).T + (0 if bias is None else bias)
            got = nat.linear_bf16_packed(x, packed, N, bias)
            assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4).item()
            rows = mx.concatenate([nat.linear_bf16_packed(x[i : i + 1], packed, N, bias) for i in range(M)])
            assert mx.array_equal(rows, got).item()
    with pytest.raises(ValueError, match="packed"):
        nat.linear_bf16_packed(mx.ones((1, 8)), mx.ones((4, 8), dtype=mx.bfloat16), 4)


def test_weights_stored_bf16(bf16_engine, engine):
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(bf16_engine.model.parameters()))
    # bf16-matmul modules the native kernel has run hold their weight as panels ("packed") instead
    linear = [k for k in params if k.endswith(("proj.weight", "proj.packed", "embed_tokens.weight", "embed_tokens.packed"))]
    assert linear and all(params[k].dtype == mx.bfloat16 for k in linear)
    norms = [k for k in params if "norm" in k]
    assert norms and all(params[k].dtype == mx.float32 for k in norms)
    total = sum(a.nbytes for a in params.values())
    fp32_total = sum(a.nbytes for _, a in tree_flatten(engine.model.parameters()))
    assert total < 0.55 * fp32_total
    assert bf16_engine.model_info.dtype == "float32"  # activations (and so the KV cache)
    assert bf16_engine.backend.dtype.startswith("bfloat16")


def test_logprob_drift_vs_fp32_bounded(bf16_engine, engine):
    mode = bf16_engine.weights_dtype
    mean_bound, max_bound, min_prefix, min_agreement = BOUNDS[mode]
    ref, got = _run(engine, PROMPTS), _run(bf16_engine, PROMPTS)
    drifts, agreed, total = [], 0, 0
    for r, g in zip(ref, got):
        same = 0
        for a, b in zip(r.token_ids, g.token_ids):
            if a != b:
                break
            same += 1
        assert same >= min_prefix, (r.text, g.text)
        agreed, total = agreed + same, total + len(r.token_ids)
        # up to and including the first divergent position both saw the same context
        for lr, lg in list(zip(r.choices[0].logprobs, g.choices[0].logprobs))[: same + (same < len(r.token_ids))]:
            if lr.token_id == lg.token_id:
                drifts.append(abs(lr.logprob - lg.logprob))
    mean, worst = sum(drifts) / len(drifts), max(drifts)
    print(f"{mode} vs fp32: mean |logprob drift| {mean:.4f}, max {worst:.4f}, "
          f"greedy agreement {agreed}/{total}")
    assert mean <= mean_bound and worst <= max_bound
    assert agreed / total >= min_agreement


def _native_linear(engine) -> bool:
    """Whether every row's sums run in a fixed order: the native kernels on, and for bfloat16-matmul its
    AVX512_BF16 linear (elsewhere that mode's linear is MLX's own matmul, even with the native kernels on)."""
    from parallm_engine.runner.weights_dtype import bf16_dot_kernel

    return engine._scheduler.native_kernels and (engine.weights_dtype != "bfloat16-matmul"
                                                 or bf16_dot_kernel() is not None)


def _same_logprobs(engine, a, b):
    """Bitwise with the native kernels (every row's sums in a fixed order); MLX's own BLAS matmul (cpu-mlx)
    may round a row differently with the batch's size, so there the tokens are what must match."""
    la, lb = [lp.logprob for lp in a.choices[0].logprobs], [lp.logprob for lp in b.choices[0].logprobs]
    if _native_linear(engine):
        return la == lb
    # bfloat16-matmul through MLX ops: a last-bit difference of the batch's matmul can move an input across
    # a bf16 rounding step, which the next layers carry: measured up to 0.044 between alone and batched
    # (the size of the mode's own drift from float32); the tokens still equal.
    return max(abs(x - y) for x, y in zip(la, lb)) < (0.1 if engine.weights_dtype == "bfloat16-matmul" else 1e-3)


def test_bf16_batched_equals_alone_and_cache_hit_equals_cold(bf16_engine):
    batched = _run(bf16_engine, PROMPTS)
    for i in (0, 3):
        alone = _run(bf16_engine, [PROMPTS[i]])[0]
        if alone.token_ids != batched[i].token_ids and bf16_engine.weights_dtype == "bfloat16-matmul" \
                and not _native_linear(bf16_engine):
            # Seen on AVX2 CPUs (no AVX512_BF16) since 4c6721a, pure-MLX path: MLX's matmul accumulates a
            # batch in another order, an activation crosses a bf16 rounding step and greedy tokens part.
            pytest.xfail("bfloat16-matmul through MLX's own matmul: batched and alone may part (lossy mode)")
        assert alone.token_ids == batched[i].token_ids
        assert _same_logprobs(bf16_engine, alone, batched[i])
    long_prompt = "A short report on rivers. " + " ".join(f"River {i} flows north." for i in range(12))
    cold = _run(bf16_engine, [long_prompt])[0]
    hit = _run(bf16_engine, [long_prompt])[0]
    assert cold.usage.cached_tokens == 0 and hit.usage.cached_tokens > 0
    assert hit.token_ids == cold.token_ids
    assert _same_logprobs(bf16_engine, hit, cold)


def test_bad_weights_dtype_is_a_typed_error(monkeypatch):
    with pytest.raises(InvalidRequestError, match="weights_dtype must be one of"):
        Engine(weights_dtype="fp8")
    monkeypatch.setenv("PARALLM_WEIGHTS_DTYPE", "int4")
    with pytest.raises(InvalidRequestError, match="PARALLM_WEIGHTS_DTYPE"):
        resolve_weights_dtype(None, "cpu")
    assert resolve_weights_dtype("bf16", "cpu") == "bfloat16"
    assert resolve_weights_dtype("bf16-matmul", "cpu") == "bfloat16-matmul"
    assert resolve_weights_dtype("bfloat16", "gpu") is None  # Metal / CUDA keep the model's dtype
    monkeypatch.delenv("PARALLM_WEIGHTS_DTYPE")
    assert resolve_weights_dtype(None, "cpu") == "float32"


def test_packed_modules_still_read_and_export_their_weights(bf16_engine):
    """After the native kernel packed a bf16-matmul module's weight into panels, ``module.weight`` and
    ``named_weights`` (what the benchmark writes for transformers) still give the (N, K) weight, and a
    forward outside the engine (MLX ops on the unpacked weight) computes what the packed kernel does."""
    from parallm_engine.runner.weights_dtype import named_weights

    bf16_engine.generate(PROMPTS[:1], max_tokens=2, temperature=0)  # the engine's forwards pack on first use
    weights = named_weights(bf16_engine.model)
    assert not any(k.endswith("packed") for k in weights)
    layer = bf16_engine.model.layers[0].mlp.up_proj
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == layer.weight.shape
    if "packed" in layer:  # the native AVX512_BF16 kernel ran here
        from parallm_engine.runner import cpu_kernels

        x = mx.random.normal((3, layer.weight.shape[1]))
        with cpu_kernels.enabled(True):
            native_out = layer(x)
        assert mx.allclose(layer(x), native_out, atol=1e-4, rtol=1e-4).item()
        emb = bf16_engine.model.model.embed_tokens
        ids = mx.array([[0, 5, 700]])
        if "packed" in emb:
            assert mx.array_equal(emb(ids), emb.weight[ids].astype(mx.float32)).item()
