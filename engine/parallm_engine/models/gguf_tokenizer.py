"""The tokenizer a GGUF file describes in its metadata (``tokenizer.ggml.*``), written as HF tokenizer files.

transformers' torch-free GGUF tokenizer builders (``transformers.integrations.gguf``) do the work: byte-level
BPE (``tokenizer.ggml.model == "gpt2"``: Qwen, Llama 3, SmolLM) with the pre-tokenizer split the file names
(``tokenizer.ggml.pre``), and SentencePiece BPE (``"llama"``: Mistral, Phi-3, Gemma, with Gemma's and Phi-3's
own fixes), control tokens as special tokens, user-defined ones (``<think>``) kept whole. What is added
here: the smollm / starcoder pre-tokenizer (digits split one by one; transformers has no entry for it),
the special-token names and chat template in ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallm_engine.errors import ModelLoadError

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

#: llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def _transformers_gguf():
    """``(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)``: transformers 5 moved them into
    ``integrations.gguf``; 4.x has them, same names and signature, in ``integrations.ggml``."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mod
    except ImportError:
        from transformers.integrations import ggml as mod
    return mod.GGUF_TOKENIZER_MAPPING, mod.convert_gguf_tokenizer


def _tokenizer_dict(meta: dict) -> dict:
    """The ``tokenizer_dict`` transformers' GGUF builders take, from ``tokenizer.ggml.*`` metadata."""
    mapping, _ = _transformers_gguf()
    return {
        name: meta[f"tokenizer.{key}"]
        for key, name in mapping["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }


def build_gguf_tokenizer(meta: dict, arch: str):
    """The ``tokenizers.Tokenizer`` the metadata describes (raises :class:`ModelLoadError` if it cannot)."""
    from tokenizers import pre_tokenizers, processors

    _, convert_gguf_tokenizer = _transformers_gguf()
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    tok_dict = _tokenizer_dict(meta)
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot build the GGUF file's tokenizer: {exc}") from exc
    if tok_dict.get("tokenizer_type") == "gpt2" and tok_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    add_bos, add_eos = special_affixes(meta)
    bos, eos = _token(meta, "tokenizer.ggml.bos_token_id"), _token(meta, "tokenizer.ggml.eos_token_id")
    if (add_bos and bos) or (add_eos and eos):
        # transformers' builders leave BOS out of the post-processor, and a tokenizer.json loaded with
        # add_bos_token=True does not get it back (Gemma without BOS produces junk): write it in here.
        pre = [bos[0]] if add_bos and bos else []
        post = [eos[0]] if add_eos and eos else []
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(pre + ["$A"] + post), pair=" ".join(pre + ["$A"] + post + pre + ["$B:1"] + post),
            special_tokens=[t for t in (bos if add_bos else None, eos if add_eos else None) if t],
        )
    return backend


def _token(meta: dict, key: str) -> tuple[str, int] | None:
    """``(token text, id)`` of the special token whose id is stored under ``key``."""
    tokens, tid = meta.get("tokenizer.ggml.tokens") or [], meta.get(key)
    return (tokens[tid], tid) if tid is not None and 0 <= tid < len(tokens) else None


def special_affixes(meta: dict) -> tuple[bool, bool]:
    """(add BOS, add EOS) when encoding: the file's flags; llama.cpp adds BOS to a SentencePiece vocabulary
    whose file does not say."""
    add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    return bool(add_bos), bool(meta.get("tokenizer.ggml.add_eos_token", False))


def write_gguf_tokenizer(meta: dict, arch: str, out_dir: Path, context_length: int) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json into ``out_dir``."""
    backend = build_gguf_tokenizer(meta, arch)
    backend.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    def name(key):
        token = _token(meta, key)
        return token[0] if token else None

    template = meta.get("tokenizer.chat_template")
    if template and "<|im_start|>" in template and "tools" not in template:
        template = CHATML_TOOLS_TEMPLATE  # same ChatML turns, plus tool calling
    add_bos, add_eos = special_affixes(meta)
    specials = [t for t, ty in zip(tokens, types) if ty == 3]  # 3 = control
    tk_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": template,
        "additional_special_tokens": specials,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tk_config, indent=2))
    special_map = {k: tk_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tk_config[k]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    gen = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
