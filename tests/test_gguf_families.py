"""GGUF files of every family the GGUF loader supports (llama, Mistral-as-llama, qwen2, qwen3, gemma3, phi3)
load through ParaLLM as the same model as their HF/MLX directory.

Each test builds a tiny random-weight model with mlx-lm's own class (tests/model_zoo.py), saves it as an
HF/MLX directory, writes the same weights as the GGUF llama.cpp's converter would make (tests/gguf_zoo.py:
gguf-py's tensor names, the converter's metadata keys, llama's Q/K permutation, Gemma's +1 on norms), and
loads both through ``parallm_engine``: logits agree to float32 precision, and the engine's greedy tokens on
the GGUF equal mlx-lm's on the directory. Stored types (F16, BF16, Q8_0, Q4_0, and Q5_0 / Q5_1 / Q4_K /
Q6_K, which mx.load cannot read) against the directory holding the values they store (see
``_check_same_model``); Llama 3's rope_freqs; the tokenizers the metadata describes against SentencePiece
itself; an unsupported architecture gets a typed error naming it.
"""

from __future__ import annotations

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine.errors import ModelLoadError, UnsupportedGGUFArchitectureError

from .gguf_zoo import GGUF_ARCH, quantize_dir, spm_model, write_bpe_vocab, write_gguf, write_spm_vocab
from .model_zoo import build, default_tokenizer, prompt_ids, reference_greedy

NEW_TOKENS = 10
SPM_VOCAB = 400
# gemma3: 7 layers with llama.cpp's fixed pattern (every 6th layer global), so the file needs no pattern key.
OVERRIDES = {"gemma3_text": {"num_hidden_layers": 7, "sliding_window_pattern": 6}}
#: model_zoo family -> tokenizer written into the GGUF: "bpe" (byte-level, pre "qwen2"/"smollm") or "spm".
TOKENIZER = {"llama": "bpe", "mistral": "spm", "qwen2": "bpe", "qwen3": "bpe", "gemma3_text": "spm", "phi3": "spm"}


@pytest.fixture(scope="module")
def default_tok():
    return default_tokenizer()


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLM_CACHE_DIR", str(tmp_path / "cache"))


def _vocab_writer(family: str, default_gguf):
    arch = GGUF_ARCH[family]
    if TOKENIZER[family] == "bpe":
        pre = "smollm" if arch == "llama" else "qwen2"
        return lambda w: write_bpe_vocab(w, default_gguf, pre)
    proto = spm_model(add_dummy_prefix=arch != "gemma3", vocab_size=SPM_VOCAB)
    return lambda w: write_spm_vocab(w, proto, arch)


def _pair(family, tmp_path, default_tok, qtype=None, embed_qtype=None, float_type=None, overrides=None):
    """(HF/MLX directory, GGUF file) holding the same weights."""
    from parallm_engine.models.loader import default_model_path

    tok_dir, bpe_vocab = default_tok
    vocab = bpe_vocab if TOKENIZER[family] == "bpe" else SPM_VOCAB
    hf = build(family, tmp_path / family, tok_dir, vocab, overrides={**OVERRIDES.get(family, {}), **(overrides or {})})
    blocks = quantize_dir(hf, qtype, embed_qtype) if qtype is not None else None
    gguf_file = write_gguf(hf, tmp_path / f"{family}.gguf", GGUF_ARCH[family],
                           _vocab_writer(family, default_model_path()), blocks, float_type)
    return hf, gguf_file, vocab


def _assert_stored_weights_equal(hf, converted, rtol=0.0):
    """The converted (MLX-quantized) model holds the HF directory's values: every quantized layer
    dequantized in float32 equals them (Q4_0 / Q4_1 / Q8_0 exactly; Q4_K to the float16 rounding of its
    group scales, ``rtol``), every other tensor is equal as it is."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_load_model

    want = mx.load(str(hf / "model.safetensors"))
    net, config = mlx_load_model(converted)
    params = dict(tree_flatten(net.parameters()))
    quantized = {k.rsplit(".", 1)[0] for k in params if k.endswith(".scales")}
    assert quantized, "nothing stayed quantized"
    for prefix in quantized:
        q = config["quantization"].get(prefix, config["quantization"])
        values = mx.dequantize(params[f"{prefix}.weight"], params[f"{prefix}.scales"].astype(mx.float32),
                               params[f"{prefix}.biases"].astype(mx.float32), q["group_size"], q["bits"])
        expected = want[f"{prefix}.weight"].astype(mx.float32)
        if rtol:  # relative to the group's largest value: the rounding is the scale's, not the value's
            bound = rtol * mx.max(mx.abs(expected).reshape(expected.shape[0], -1, 32), axis=-1, keepdims=True)
            assert mx.all(mx.abs(values - expected).reshape(bound.shape[0], -1, 32) <= bound).item(), prefix
        else:
            assert mx.array_equal(values, expected).item(), prefix
    for name, value in want.items():
        if name.rsplit(".", 1)[0] not in quantized:
            assert mx.allclose(params[name].astype(mx.float32), value.astype(mx.float32), atol=1e-6).item(), name


def _check_same_model(hf, gguf_file, vocab, mx_quantized=False, weights_rtol=0.0):
    """Float files: logits of the GGUF equal the HF directory's to float32 precision. MLX-quantized files
    (Q4_0 / Q4_1 / Q8_0): the stored values are exact (:func:`_assert_stored_weights_equal`), and the float32
    reference is mlx-lm's own model on the converted directory (MLX dequantizes with float16 scales, which
    rounds; that is MLX's arithmetic, the same on either side). Then the engine's greedy tokens on the GGUF
    equal the reference's."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_load

    from parallm_engine import Engine
    from parallm_engine.models.gguf import ensure_converted
    from parallm_engine.models.loader import load_model

    net, tokenizer, info = load_model(str(gguf_file), dtype="float32")
    assert info.config["gguf_source"]["file"] == str(gguf_file)
    prompts = [prompt_ids(n, vocab, seed=i) for i, n in enumerate((37, 19))]
    if mx_quantized:
        converted = ensure_converted(gguf_file)
        _assert_stored_weights_equal(hf, converted, weights_rtol)
        ref = dequantize_model(mlx_load(str(converted))[0])
        ref.set_dtype(mx.float32)
    else:
        ref, _, _ = load_model(str(hf), dtype="float32")
    for p in prompts:
        want = np.array(ref(mx.array(p)[None])[0])
        got = np.array(net(mx.array(p)[None])[0])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    wanted = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
    assert [reference_greedy(net, p, NEW_TOKENS) for p in prompts] == wanted
    eng = Engine(str(gguf_file), max_batch_size=4, prefill_chunk=64)
    try:
        got = eng.generate(prompts, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in got] == wanted, "engine greedy on the GGUF differs from mlx-lm on the HF dir"
    finally:
        eng.shutdown()
    return tokenizer


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_family_matches_hf_dir(family, tmp_path, default_tok):
    hf, gguf_file, vocab = _pair(family, tmp_path, default_tok)
    tokenizer = _check_same_model(hf, gguf_file, vocab)
    text = "Hello world, 2024!"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    with_specials = tokenizer.encode(text)  # SentencePiece files ask for BOS, the byte-level ones here not
    assert (with_specials[0] == tokenizer.bos_token_id) == (TOKENIZER[family] == "spm")


@pytest.mark.parametrize(
    "family,qtype,embed_qtype,float_type",
    [
        ("qwen3", "Q4_0", "Q8_0", None),  # both stay MLX-quantized (mx.load)
        ("llama", "Q8_0", None, None),  # quantized rows permuted together
        ("gemma3_text", "Q5_0", "Q8_0", None),  # mx.load cannot read Q5_0: re-packed as MLX 5-bit, exact
        ("mistral", "Q5_1", None, None),
        ("gemma3_text", None, None, "BF16"),  # read exactly (mx.load would round to float16)
        ("phi3", None, None, "F16"),
    ],
)
def test_gguf_stored_types(family, qtype, embed_qtype, float_type, tmp_path, default_tok):
    from gguf.constants import GGMLQuantizationType as Q

    qtype, embed_qtype = (Q[q] if q else None for q in (qtype, embed_qtype))
    float_type = Q[float_type] if float_type else None
    if float_type is not None:  # float matrices: the HF dir holds the values the file stores
        hf, gguf_file, vocab = _pair(family, tmp_path, default_tok, qtype=float_type, float_type=float_type)
    else:
        hf, gguf_file, vocab = _pair(family, tmp_path, default_tok, qtype=qtype, embed_qtype=embed_qtype)
    _check_same_model(hf, gguf_file, vocab, mx_quantized=qtype is not None)


def test_gguf_llama3_rope_freqs(tmp_path, default_tok):
    """Llama 3.1+ files keep their "llama3" rope_scaling only as the ``rope_freqs`` tensor; the loader fits the
    scaling back (every band crossed: original context 64, head_dim 16)."""
    import json

    from parallm_engine.models.gguf import ensure_converted

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    hf, gguf_file, vocab = _pair("llama", tmp_path, default_tok, overrides={"rope_scaling": llama3})
    _check_same_model(hf, gguf_file, vocab)
    assert json.loads((ensure_converted(gguf_file) / "config.json").read_text())["rope_scaling"] == llama3


def test_gguf_k_quants(tmp_path, default_tok):
    """Ollama's default Q4_K_M mix, which mx.load cannot read: Q4_K re-packed as MLX 4-bit group 32 (kept
    quantized), Q6_K dequantized by gguf-py to bfloat16 (the HF dir holds those bfloat16 values)."""
    import json

    from gguf.constants import GGMLQuantizationType as Q

    from parallm_engine.models.gguf import ensure_converted

    dims = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}  # K-quant blocks are 256 wide
    for family in ("qwen2", "llama"):  # llama: the Q/K permutation moves Q4_K rows with their scales
        hf, gguf_file, vocab = _pair(family, tmp_path, default_tok, qtype=Q.Q4_K, embed_qtype=Q.Q6_K,
                                     overrides=dims)
        _check_same_model(hf, gguf_file, vocab, mx_quantized=True, weights_rtol=2**-9)
        quant = json.loads((ensure_converted(gguf_file) / "config.json").read_text())["quantization"]
        assert (quant["bits"], quant["group_size"]) == (4, 32)


def test_spm_tokenizers_match_sentencepiece(tmp_path):
    """SentencePiece vocabularies (Mistral / Phi-3 with the dummy prefix, Gemma without) as llama.cpp writes
    them tokenize like SentencePiece itself."""
    import gguf
    import sentencepiece as spm

    from parallm_engine.models.gguf_reader import read_gguf_header
    from parallm_engine.models.gguf_tokenizer import build_gguf_tokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Hello world, 12345 and 3.14!", "café résumé 😀",
             "Paris is the capital of France."]
    for arch, prefix in (("llama", True), ("phi3", True), ("gemma3", False)):
        proto = spm_model(add_dummy_prefix=prefix, vocab_size=SPM_VOCAB)
        path = tmp_path / f"{arch}-vocab.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        write_spm_vocab(writer, proto, arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        meta, _ = read_gguf_header(path, arrays=True)
        tok = build_gguf_tokenizer(meta, arch)
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for text in texts:
            got = tok.encode(text, add_special_tokens=False).ids
            assert got == sp.encode(text), (arch, text, got, sp.encode(text))
            assert tok.decode(got) == text
            # add_bos_token (llama.cpp's default for SentencePiece): BOS first, as llama.cpp encodes
            assert tok.encode(text).ids == [sp.bos_id()] + sp.encode(text)


def test_bpe_tokenizer_qwen2_split_and_specials(tmp_path, default_tok):
    """Byte-level BPE under llama.cpp's "qwen2" pre-tokenizer: digits one by one, control tokens whole,
    lossless round trip."""
    from transformers import AutoTokenizer

    hf, gguf_file, _ = _pair("qwen3", tmp_path, default_tok)
    from parallm_engine.models.gguf import ensure_converted

    tok = AutoTokenizer.from_pretrained(str(ensure_converted(gguf_file)))
    text = "<|im_start|>user\nIt costs 12345 dollars, café 😀<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    pieces = tok.convert_ids_to_tokens(tok.encode(" 12345", add_special_tokens=False))
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "3", "4", "5"]


def test_unsupported_architecture_is_a_typed_error(tmp_path):
    import gguf
    import numpy as np

    from parallm_engine.models.gguf import ensure_converted, gguf_architecture
    from parallm_engine.models.loader import default_model_path, load_model

    assert gguf_architecture(default_model_path()) == ("llama", True)
    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == ("mamba", False)
    with pytest.raises(UnsupportedGGUFArchitectureError) as info:
        ensure_converted(path)
    assert info.value.architecture == "mamba"
    assert {"llama", "qwen2", "qwen3", "gemma3", "phi3"} <= set(info.value.supported)
    assert "'mamba'" in str(info.value) and "qwen3" in str(info.value)
    with pytest.raises(ModelLoadError, match="mamba"):  # the same through the loader users call
        load_model(str(path))
    assert not list((tmp_path / "cache" / "models").glob("tiny-mamba*"))  # nothing half-converted left
