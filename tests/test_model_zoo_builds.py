"""Fast checks of the test utility ``tests/model_zoo.py`` itself: three representative families (a plain
transformer, sliding + global attention, linear attention + attention) build, load back through
``mlx_lm.utils.load`` exactly, and mlx-lm's own greedy generation on them is deterministic and not
degenerate. The engine-vs-mlx-lm comparisons over every family live in test_model_zoo.py."""

from __future__ import annotations

import json

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)

from .model_zoo import FAMILIES, SURVEY, build, cache_types, default_tokenizer, prompt_ids, reference_greedy

REPRESENTATIVE = ["llama", "gemma3_text", "qwen3_next"]


@pytest.fixture(scope="module")
def tokenizer_dir():
    return default_tokenizer()


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_family_builds_loads_and_generates_deterministically(family, tmp_path, tokenizer_dir):
    from mlx_lm.utils import load

    tok_dir, vocab = tokenizer_dir
    path = build(family, tmp_path / family, tok_dir, vocab)  # verify=True: every tensor loads back unchanged
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == FAMILIES[family]["model_type"] and config["vocab_size"] == vocab
    assert (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists()

    model, tokenizer = load(str(path))
    assert model.args.model_type == FAMILIES[family]["model_type"]
    assert cache_types(model) == SURVEY[family]["caches"]  # e.g. both sliding and full layers exist
    assert tokenizer.vocab_size <= vocab

    prompt = prompt_ids(40, vocab)  # longer than the 8-token sliding window
    first = reference_greedy(model, prompt, 12)
    assert len(first) == 12 and all(0 <= t < vocab for t in first)
    assert reference_greedy(model, prompt, 12) == first
    # Not degenerate: varied tokens, and the context (not only the last token) decides them.
    assert len(set(first)) >= 6, first
    assert reference_greedy(model, [prompt[0] + 1] + prompt[1:], 12) != first


def test_same_seed_same_weights_and_4bit_loads_quantized(tmp_path, tokenizer_dir):
    import mlx.nn as nn
    from mlx_lm.utils import load

    tok_dir, vocab = tokenizer_dir
    a = build("llama", tmp_path / "a", tok_dir, vocab, verify=False)
    b = build("llama", tmp_path / "b", tok_dir, vocab, verify=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()

    q = build("llama", tmp_path / "q4", tok_dir, vocab, quantize_bits=4)
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == 4
    model, _ = load(str(q))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    prompt = prompt_ids(40, vocab, seed=1)
    assert reference_greedy(model, prompt, 8) == reference_greedy(model, prompt, 8)
