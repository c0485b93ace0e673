"""Tiny random-weight reasoning models for tests/test_reasoning.py (not a test file).

* Qwen3 (``model_zoo``'s ``qwen3`` family) with ``<think>`` / ``</think>`` added to the default model's
  tokenizer as special tokens and Qwen3's real chat template, whose generation prompt here opens ``<think>\\n``
  when thinking is on (as Qwen3-2507 Thinking's does) and writes the empty ``<think>\\n\\n</think>\\n\\n`` when
  ``enable_thinking`` is false (the hybrid Qwen3 switch). A random-weight model never writes ``<think>`` of
  its own accord, so the prompt opens the span: every token the model writes is reasoning until it writes
  ``</think>`` (which the greedy tiny model does not) or a thinking budget closes it.
* gpt-oss (``gpt_oss`` family) with the harmony control tokens and a harmony template (``Reasoning:`` line
  from ``reasoning_effort``); its generation prompt ends ``<|start|>assistant`` and a lark grammar makes the
  model open an analysis message (the budget then closes it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.model_zoo import build, default_tokenizer

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json), verbatim but for the generation prompt's
# thinking switch, which opens "<think>\n" when thinking is on (Qwen3-2507 Thinking's generation prompt).
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == \"tool\" %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# A harmony template in gpt-oss's shape: earlier turns' analysis is never rendered (gpt-oss's template drops
# it too, but for a tool-calling turn in progress).
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: ' + (reasoning_effort or 'medium') + "
    "'\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + "
    "'<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)


def _tokenizer_dir(out: Path, template: str, tokens: list[str], eos: list[str] | None = None) -> tuple[Path, int]:
    """The default model's tokenizer with ``tokens`` added as special tokens and ``template`` as its chat
    template (config.json too: build() takes its special token ids)."""
    from tokenizers import AddedToken, Tokenizer

    src, _ = default_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    size = tok.get_vocab_size(with_added_tokens=True)
    if eos:
        ids = [tok.token_to_id(t) for t in eos]
        config = json.loads((out / "config.json").read_text())
        config["eos_token_id"] = ids
        (out / "config.json").write_text(json.dumps(config))
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return out, size


def build_qwen3_thinking(root: Path) -> Path:
    tok_dir, size = _tokenizer_dir(root / "tokenizer", QWEN3_TEMPLATE, THINK_TOKENS)
    return build("qwen3", root / "model", tok_dir, size)


def build_gpt_oss_harmony(root: Path) -> Path:
    tok_dir, size = _tokenizer_dir(root / "tokenizer", HARMONY_TEMPLATE, HARMONY_TOKENS, eos=["<|return|>", "<|call|>"])
    return build("gpt_oss", root / "model", tok_dir, size)
