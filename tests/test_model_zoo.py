"""Every supported model family, on tiny random-weight models (``tests/model_zoo.py``), against mlx-lm:

- greedy tokens equal mlx-lm's own ``generate_step`` on the same weights (the reference), for prompts
  that cross the sliding windows / chunks / recurrent state several times;
- batched equals alone (prompts of different lengths decoding together);
- a prefix-cache hit equals a cold run;
- a seeded sampled request gives the same tokens alone and in a batch;
- logprobs equal the model's own ``__call__`` within 1e-4.

Families the engine cannot batch correctly are refused at load with a typed error (checked here too).
"""

from __future__ import annotations

import math

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)

from .model_zoo import build, default_tokenizer, prompt_ids, reference_greedy

# Families the engine runs (every one mlx-lm 0.32 ships of the list, plus quantized variants).
SUPPORTED = [
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "ministral3", "gemma2", "gemma3_text", "phi3",
    "granite", "cohere", "cohere2", "gpt_oss", "olmo2", "olmo3", "deepseek_v3", "minicpm", "llama4_text",
    "qwen3_next",
    "lfm2", "nemotron_h", "falcon_h1", "mamba2", "mamba",
]
QUANTIZED = ["llama", "qwen3"]
# Refused at load: mlx-lm's chunked-attention cache (Llama 4's) has no batched form.
REFUSED = {"llama4": "ChunkedKVCache"}

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer_dir():
    return default_tokenizer()


def _engine(path):
    from parallm_engine import Engine

    return Engine(str(path), max_batch_size=8, prefill_chunk=64, prefill_budget=256, decode_lanes=1)


def _reference_model(path, engine):
    """mlx-lm's own model on the same weights, in the dtype the engine runs."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load

    model, _ = load(str(path))
    if engine.model_info.dtype == "float32":
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
    return model


def _check_family(family: str, tmp_path, tokenizer_dir, quantize_bits=None, **build_kwargs):
    import mlx.core as mx

    tok_dir, vocab = tokenizer_dir
    path = build(family, tmp_path / family, tok_dir, vocab, quantize_bits=quantize_bits, **build_kwargs)
    eng = _engine(path)
    try:
        ref = _reference_model(path, eng)
        prompts = [prompt_ids(n, vocab, seed=i) for i, n in enumerate((41, 100, 23))]
        want = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]

        # Greedy, each alone (cold: the prefix cache is cleared first), equals mlx-lm.
        alone = []
        for p in prompts:
            eng.clear_prefix_cache()
            alone.append(eng.generate([p], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)[0].token_ids)
        assert alone == want, f"{family}: engine greedy differs from mlx-lm"

        # Batched (different lengths together) equals alone.
        eng.clear_prefix_cache()
        together = eng.generate(prompts, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in together] == want, f"{family}: batched differs from alone"

        # A long prompt prefilled chunk by chunk while the others decode equals alone: each chunk spends the
        # step's whole prefill budget, so where the family allows it runs in the decode forward (fused step).
        long = prompt_ids(150, vocab, seed=5)
        eng.clear_prefix_cache()
        budget = eng.config.prefill_budget
        fused = eng.stats()["fused_prefill_tokens"]
        eng.config.prefill_budget = eng.config.prefill_chunk
        try:
            beside = eng.generate(prompts + [long], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        finally:
            eng.config.prefill_budget = budget
        assert [r.token_ids for r in beside] == want + [reference_greedy(ref, long, NEW_TOKENS)], \
            f"{family}: a prompt chunked beside decoding rows differs"
        if eng._scheduler.runner.split is not None:
            assert eng.stats()["fused_prefill_tokens"] - fused >= 64, f"{family}: no chunk ran in a decode forward"

        # A cache hit equals the cold run: the same prompts again, now cached (prompt + output stored).
        again = eng.generate(prompts, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in again] == want, f"{family}: cache hit differs from cold run"
        assert all(r.usage.cached_tokens > 0 for r in again), f"{family}: no prefix-cache hit"
        # A continuation of a previous turn (its prompt + output + more) hits what the turn stored.
        turn2 = prompts[0] + want[0] + prompt_ids(9, vocab, seed=7)
        hit = eng.generate([turn2], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)[0]
        assert hit.usage.cached_tokens >= len(prompts[0]), f"{family}: next turn missed the cache"
        assert hit.token_ids == reference_greedy(ref, turn2, NEW_TOKENS), f"{family}: next-turn hit differs"

        # Seeded sampling: the same tokens alone and in a batch.
        seeded = dict(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
        solo = eng.generate([prompts[1]], **seeded)[0].token_ids
        mixed = eng.generate([prompts[0], prompts[1], prompts[2]], max_tokens=NEW_TOKENS, temperature=0.8,
                             ignore_eos=True)  # unseeded neighbours
        assert len(mixed) == 3
        handles = [eng.submit(p, max_tokens=NEW_TOKENS, temperature=0.7, ignore_eos=True) for p in prompts]
        in_batch = eng.generate([prompts[1]], **seeded)[0].token_ids
        for h in handles:
            list(h)
        assert solo == in_batch, f"{family}: seeded output depends on the batch"

        # Logprobs of the greedy tokens equal the model's own __call__ on the full sequence.
        r = eng.generate([prompts[2]], max_tokens=4, temperature=0, logprobs=True, ignore_eos=True)[0]
        seq = prompts[2] + r.token_ids
        logits = ref(mx.array(seq)[None])[0].astype(mx.float32)
        own = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for i, lp in enumerate(r.logprobs):
            expected = own[len(prompts[2]) - 1 + i, lp.token_id].item()
            assert math.isclose(lp.logprob, expected, abs_tol=1e-4), (family, i, lp.logprob, expected)
        return eng
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_matches_mlx_lm(family, tmp_path, tokenizer_dir):
    _check_family(family, tmp_path, tokenizer_dir)


@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_family_matches_mlx_lm(family, tmp_path, tokenizer_dir):
    _check_family(family, tmp_path, tokenizer_dir, quantize_bits=4)


def test_mxfp4_gpt_oss_matches_mlx_lm(tmp_path, tokenizer_dir):
    """gpt-oss as it ships: mxfp4 weights (group 32). The KV size is the activations' dtype's."""
    eng = _check_family("gpt_oss", tmp_path, tokenizer_dir, quantize_bits=4, quant_mode="mxfp4", group_size=32)
    assert eng.model_info.dtype in ("float32", "bfloat16", "float16")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unbatchable_family_is_refused_at_load(family, tmp_path, tokenizer_dir):
    from parallm_engine import Engine
    from parallm_engine.errors import ModelLoadError, UnsupportedModelError

    tok_dir, vocab = tokenizer_dir
    path = build(family, tmp_path / family, tok_dir, vocab)
    with pytest.raises(UnsupportedModelError, match=REFUSED[family]) as err:
        Engine(str(path))
    assert isinstance(err.value, ModelLoadError)
