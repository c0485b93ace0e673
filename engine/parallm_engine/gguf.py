"""Convert a llama-family GGUF file (what Ollama / LM Studio users already have) into an HF-layout
model directory that mlx-lm loads, cached on disk so later starts skip the conversion.

``mx.load`` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized
(weight, scales, biases) triples with group size 32, float tensors as they are. What this module adds:
tensor names mapped to HF Llama names, llama.cpp's Q/K row permutation undone (quantization groups run
along columns, so packed weight, scales and biases are permuted by row together), ``config.json`` from
the metadata, and the tokenizer (byte-level BPE + special tokens + chat template) rebuilt from the
metadata with the ``tokenizers`` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ModelLoadError

# A ChatML template (SmolLM2's own, with its default system prompt) extended with the Hermes / Qwen
# tool-calling convention: tools listed in the system turn, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> user turns. mlx-lm's `json_tools` parser reads this format.
CHATML_TOOLS_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system_message = default_system -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system_message -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (message['content'] if message['content'] is string else (message['content'] | tojson)) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}"
    "{%- for tc in message['tool_calls'] -%}"
    "{%- set fn = tc['function'] if tc.get('function') else tc -%}"
    "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CONVERTER_VERSION = "4"  # bump when the converted layout changes, to invalidate caches

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def default_cache_dir() -> Path:
    root = os.environ.get("PARALLM_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "parallm" if xdg else Path.home() / ".cache" / "parallm"


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{_CONVERTER_VERSION}".encode())
    return h.hexdigest()[:16]


def converted_dir_for(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    return cache_dir / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"


def ensure_converted(gguf_path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """Return an mlx-lm loadable directory for ``gguf_path``, converting it once if needed."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    out = converted_dir_for(gguf_path, cache_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename: concurrent processes never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


#: GGUF metadata value types (gguf spec) -> struct format; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(gguf_path: str | os.PathLike, want=lambda key: True) -> dict:
    """The scalar and string metadata of a GGUF file whose keys ``want`` accepts (arrays are skipped).

    Pure Python over the header only (no mlx, no tensors), so it is cheap enough to call at construction
    time. Raises :class:`ModelLoadError` for a file that is not GGUF."""
    import mmap
    import struct

    out: dict = {}
    with open(gguf_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{gguf_path} is not a GGUF file")
        version = struct.unpack_from("<I", buf, 4)[0]
        count_fmt = "<I" if version == 1 else "<Q"
        size = struct.calcsize(count_fmt)
        pos = 8 + size  # magic, version, tensor count
        (n_kv,) = struct.unpack_from(count_fmt, buf, pos)
        pos += size

        def string(pos):
            (n,) = struct.unpack_from(count_fmt, buf, pos)
            pos += size
            return bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

        def skip(vtype, pos):
            if vtype in _GGUF_SCALARS:
                return pos + struct.calcsize(_GGUF_SCALARS[vtype])
            if vtype == 8:
                (n,) = struct.unpack_from(count_fmt, buf, pos)
                return pos + size + n
            if vtype == 9:
                etype, n = struct.unpack_from("<I" + count_fmt[1], buf, pos)
                pos += 4 + size
                if etype in _GGUF_SCALARS:
                    return pos + n * struct.calcsize(_GGUF_SCALARS[etype])
                for _ in range(n):
                    pos = skip(etype, pos)
                return pos
            raise ModelLoadError(f"{gguf_path}: unknown GGUF metadata type {vtype}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if want(key) and vtype in _GGUF_SCALARS:
                out[key] = struct.unpack_from("<" + _GGUF_SCALARS[vtype], buf, pos)[0]
            elif want(key) and vtype == 8:
                out[key] = string(pos)[0]
            pos = skip(vtype, pos)
    return out


#: llama.cpp's ``general.sampling.*`` metadata keys (written by convert_hf_to_gguf from the model's
#: generation_config.json) -> ParaLLM's sampling names; the later spellings are other tools'.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.temperature": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.repeat_penalty": "repetition_penalty",
    "general.sampling.repetition_penalty": "repetition_penalty",
}


def gguf_sampling_defaults(gguf_path: str | os.PathLike) -> dict:
    """The sampling settings a GGUF file recommends in its metadata (empty if it has none)."""
    meta = read_gguf_metadata(gguf_path, want=lambda key: key in GGUF_SAMPLING_KEYS)
    # Floats are stored as float32: 0.2 reads back as 0.20000000298..., so round to float32 precision.
    return {GGUF_SAMPLING_KEYS[k]: round(v, 6) if isinstance(v, float) else v for k, v in meta.items()}


def _unpermute_rows(x, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`)."""
    rows = x.shape[0]
    rest = x.shape[1:]
    # llama.cpp wrote reshape(H, 2, D/2).swapaxes(1, 2); the inverse reads it as (H, D/2, 2).
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import mlx.core as mx

    try:
        weights, meta = mx.load(str(gguf_path), format="gguf", return_metadata=True)  # Ollama blobs have no suffix
    except Exception as exc:  # mx.load raises plain ValueError/RuntimeError for bad files
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported by the GGUF loader yet (llama only); "
            "convert it to an HF/MLX directory with mlx_lm.convert instead"
        )
    n_head = int(_scalar(meta, "llama.attention.head_count"))
    n_kv = int(_scalar(meta, "llama.attention.head_count_kv", n_head))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    n_layers = int(_scalar(meta, "llama.block_count"))
    head_dim = int(_scalar(meta, "llama.rope.dimension_count", hidden // n_head))

    out_w: dict = {}
    quant: dict = {}
    for name, arr in weights.items():
        base, _, suffix = name.rpartition(".")  # suffix: weight / scales / biases
        parts = base.split(".")
        if parts[0] == "blk":
            layer, key = int(parts[1]), ".".join(parts[2:])
            if key not in _LAYER_NAMES:
                raise ModelLoadError(f"unexpected GGUF tensor {name}")
            hf = f"model.layers.{layer}.{_LAYER_NAMES[key]}"
            if key == "attn_q":
                arr = _unpermute_rows(arr, n_head)
            elif key == "attn_k":
                arr = _unpermute_rows(arr, n_kv)
        elif base in _TOP_NAMES:
            hf = _TOP_NAMES[base]
        else:
            raise ModelLoadError(f"unexpected GGUF tensor {name}")
        out_w[f"{hf}.{suffix}"] = arr
        if suffix == "scales":
            packed = weights[f"{base}.weight"]
            bits = packed.shape[-1] * 32 // (arr.shape[-1] * 32)  # 32-value groups
            quant[hf] = {"group_size": 32, "bits": int(bits), "mode": "affine"}

    vocab_size = int(_scalar(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"])))
    tied = "lm_head.weight" not in out_w
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float16",
        "gguf_source": {"file": str(gguf_path), "name": _scalar(meta, "general.name"),
                         "license": _scalar(meta, "general.license")},
    }
    if quant:
        # mlx-lm reads per-layer overrides keyed by module path; the common setting is the default.
        common = max(quant.values(), key=lambda q: sum(v == q for v in quant.values()))
        qcfg = dict(common)
        for path, q in quant.items():
            if q != common:
                qcfg[path] = q
        # Layers not quantized in the file (norms are vectors; nothing else expected) are skipped
        # by mlx-lm because they have no `.scales`.
        config["quantization"] = qcfg
        config["quantization_config"] = qcfg

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), out_w, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(meta, out_dir)


def _write_tokenizer(meta: dict, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    model_kind = _scalar(meta, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {model_kind!r} not supported (byte-level BPE only)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _scalar(meta, "tokenizer.ggml.pre", "default")
    steps = []
    if pre in ("smollm", "starcoder", "refact", "default", "gpt-2", "llama-bpe"):
        # llama.cpp's smollm/starcoder pre-tokenizers split every digit on its own first.
        if pre in ("smollm", "starcoder", "refact"):
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} not supported yet")
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control (special) tokens: never split, skipped when decoding specials.
    specials = [t for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(specials)
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key):
        tid = _scalar(meta, key)
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    template = _scalar(meta, "tokenizer.chat_template")
    if template and "<|im_start|>" in template and "tools" not in template:
        template = CHATML_TOOLS_TEMPLATE  # same ChatML turns, plus tool calling
    tk_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 2048)),
        "chat_template": template,
        "additional_special_tokens": specials,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tk_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: tk_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tk_config[k]}, indent=2)
    )
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    gen = {"bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"), "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
