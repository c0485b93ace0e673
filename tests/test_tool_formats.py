"""Tool-call formats per model family and reasoning separation.

For every supported format: a hand-written output in that format parses into the right calls, whole and
streamed in random pieces (the same calls, content and reasoning either way); the constrained grammar in
that format accepts a valid call (which then parses) and rejects garbage; detection picks the format
from the chat template / tokenizer. On tiny random-weight models whose templates render Llama 3 JSON and
gpt-oss harmony, ``ChatParaLLM.bind_tools(..., tool_choice="required")`` returns calls, and harmony
analysis text forced into the output lands in ``reasoning_content``, not in the answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallm_engine.formats.chat_format import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCallDelta,
    parse_tool_calls,
    parser_for,
)
from parallm_engine.formats.harmony import HarmonyFormat
from parallm_engine.formats.tool_formats import HermesFormat, Llama3JsonFormat, MlxLmFormat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
THINK = ("<think>", "</think>")

PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"tz": "UTC"})

# (format factory, reasoning markers, model output, calls, content, reasoning)
CASES = {
    "hermes": (HermesFormat, None,
               'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               [PARIS, UTC], "Let me check.", None),
    "qwen3_think_hermes": (HermesFormat, THINK,
                           '<think>\nThe user wants Paris weather.\n</think>\n\n'
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                           [PARIS], "", "The user wants Paris weather."),
    "qwen3_think_answer": (HermesFormat, THINK, "<think>\nEasy.\n</think>\n\nIt is 4.", [], "It is 4.", "Easy."),
    "llama3_json": (Llama3JsonFormat, None, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    [PARIS], "", None),
    "llama3_python_tag": (Llama3JsonFormat, None,
                          '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                          '{"name": "get_time", "parameters": {"tz": "UTC"}}', [PARIS, UTC], "", None),
    "llama3_text": (Llama3JsonFormat, None, "It is sunny in {Paris} today.", [], "It is sunny in {Paris} today.", None),
    "harmony_call": (HarmonyFormat, None,
                     "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>"
                     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                     [PARIS], "", "Need the weather tool."),
    "harmony_recipient_in_header": (HarmonyFormat, None,
                                    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
                                    '{"tz": "UTC"}', [UTC], "", None),
    "harmony_final": (HarmonyFormat, None,
                      "<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Paris is the capital.<|return|>", [], "Paris is the capital.", "Simple question."),
    "mistral_json": (lambda: MlxLmFormat("mistral"), None,
                     'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', [PARIS, UTC], "Sure.", None),
    "mistral_args": (lambda: MlxLmFormat("mistral", "[ARGS]"), None,
                     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
                     [PARIS, UTC], "", None),
    "pythonic": (lambda: MlxLmFormat("pythonic"), None,
                 'Checking.<|tool_call_start|>[get_weather(city="Paris"), get_time(tz="UTC")]<|tool_call_end|>',
                 [PARIS, UTC], "Checking.", None),
    "qwen3_coder": (lambda: MlxLmFormat("qwen3_coder"), None,
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", [PARIS], "", None),
    "glm47": (lambda: MlxLmFormat("glm47"), None,
              "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
              [PARIS], "", None),
    "kimi_k2": (lambda: MlxLmFormat("kimi_k2"), None,
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', [PARIS], "", None),
    "gemma4": (lambda: MlxLmFormat("gemma4"), None, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
               [PARIS], "", None),
    "function_gemma": (lambda: MlxLmFormat("function_gemma"), None,
                       "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
                       [PARIS], "", None),
    "minimax_m2": (lambda: MlxLmFormat("minimax_m2"), None,
                   '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris</parameter></invoke>'
                   "</minimax:tool_call>", [PARIS], "", None),
    "longcat": (lambda: MlxLmFormat("longcat"), None,
                "<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris"
                "</longcat_arg_value></longcat_tool_call>", [PARIS], "", None),
    "minicpm5": (lambda: MlxLmFormat("minicpm5"), None,
                 '<function name="get_weather"><param name="city">Paris</param></function>', [PARIS], "", None),
}


def _parser(case: str) -> OutputParser:
    factory, think = CASES[case][:2]
    return OutputParser(factory(), think, None)


def _collect(events) -> tuple[str, str, dict[int, dict]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.reasoning for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            c = calls.setdefault(e.index, {"id": None, "name": None, "args": ""})
            if e.id is not None:
                c["id"], c["name"] = e.id, e.name
            c["args"] += e.arguments_delta
    return content, reasoning, calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_output_parses_into_calls(case):
    _, _, text, calls, content, reasoning = CASES[case]
    got_content, got_reasoning, got_calls = _parser(case).parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert got_content == content
    assert got_reasoning == reasoning
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_in_random_pieces_gives_the_same_result(case, data):
    _, _, text, calls, content, reasoning = CASES[case]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = _parser(case).stream(TOOLS)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    got_content, got_reasoning, streamed = _collect(events)
    assert [(c.name, c.arguments) for c in stream.calls] == calls
    # The argument pieces of each call add up to its arguments' JSON; ids match the final calls.
    assert [(streamed[i]["name"], json.loads(streamed[i]["args"])) for i in sorted(streamed)] == calls
    assert [streamed[i]["id"] for i in sorted(streamed)] == [c.id for c in stream.calls]
    assert got_content.strip() == content and (got_reasoning.strip() or None) == reasoning
    assert stream.content == got_content and stream.reasoning == got_reasoning


def test_stream_state_is_per_request():
    """Two requests streaming through one engine-wide parser at once (vllm-mlx#649 shared the state and
    mixed their calls up)."""
    parser = _parser("harmony_call")
    a, b = parser.stream(TOOLS), parser.stream(TOOLS)
    text_a = CASES["harmony_call"][2]
    text_b = ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>')
    for i in range(max(len(text_a), len(text_b))):
        a.feed(text_a[i : i + 1])
        b.feed(text_b[i : i + 1])
    a.finish(), b.finish()
    assert [(c.name, c.arguments) for c in a.calls] == [PARIS] and a.reasoning == "Need the weather tool."
    assert [(c.name, c.arguments) for c in b.calls] == [UTC] and b.reasoning == ""


def test_calls_to_tools_not_offered_stay_content():
    text = '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>'
    content, reasoning, calls = OutputParser(HermesFormat()).parse(text, [WEATHER])
    assert calls == [] and content == text
    stream = OutputParser(HermesFormat()).stream([WEATHER])
    events = [e for i in range(len(text)) for e in stream.feed(text[i])] + stream.finish()
    assert not any(isinstance(e, ToolCallDelta) for e in events) and _collect(events)[0] == text
    harmony = 'x<|channel|>commentary to=functions.send_email <|constrain|>json<|message|>{}'
    content, _, calls = OutputParser(HarmonyFormat()).parse(harmony, [WEATHER])
    assert calls == [] and "send_email" in content
    # no tools: nothing is a call, but reasoning still leaves the answer
    content, reasoning, calls = OutputParser(HarmonyFormat()).parse(CASES["harmony_call"][2], None)
    assert calls == [] and reasoning == "Need the weather tool." and "analysis" not in content


def test_reasoning_opened_by_the_prompt():
    """Templates that end the generation prompt with ``<think>`` (DeepSeek-R1, Qwen3 thinking): the output
    has only the closing marker. Told by the prompt's token ids when given, by the text otherwise."""
    parser = OutputParser(HermesFormat(), THINK, ((7,), (8,)))
    assert parser.parse("Let me think.\n</think>\n\nFour.", None) == ("Four.", "Let me think.", [])
    stream = parser.stream(None, prompt_ids=[1, 2, 7])
    events = stream.feed("Let me ") + stream.feed("think.</th") + stream.feed("ink>Four.") + stream.finish()
    assert _collect(events)[:2] == ("Four.", "Let me think.")
    assert parser.parse("Four.", None, prompt_ids=[1, 7, 8]) == ("Four.", None, [])


def test_parse_tool_calls_keeps_its_signature():
    content, calls = parse_tool_calls(CASES["hermes"][2], TOOLS)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]


# -- detection from the tokenizer / chat template ---------------------------------------------------

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set msgs = messages[1:] %}{%- else %}{%- set system = '' %}{%- set msgs = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for m in msgs %}"
    "{%- if m['role'] == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a "
    "function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n\\n' }}{%- endfor %}{{- m['content'] + '<|eot_id|>' }}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- for tc in m['tool_calls'] %}"
    "{{- '{\"name\": \"' + tc['function']['name'] + '\", \"parameters\": ' + (tc['function']['arguments'] | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>"]

HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: low\\n\\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for t in tools %}{%- set f = t['function'] if t.get('function') else t %}"
    "{{- '\\n// ' + (f.get('description') or '') + '\\ntype ' + f['name'] + ' = (_: ' + (f['parameters'] | tojson) + ') => any;\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}{%- for tc in m['tool_calls'] %}"
    "{{- '<|start|>assistant to=functions.' + tc['function']['name'] + '<|channel|>commentary json<|message|>' + "
    "(tc['function']['arguments'] | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|start|>functions.' + (m.get('name') or 'tool') + ' to=assistant"
    "<|channel|>commentary<|message|>' + m['content'] + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def _tokenizer_dir(out: Path, src: Path, template: str | None, tokens: list[str]) -> int:
    """The default model's tokenizer with extra special tokens and a chat template; returns the vocab size."""
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(out / "tokenizer.json"))
    if template is not None:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size(with_added_tokens=True)


def _load_tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


@pytest.fixture(scope="module")
def default_src(engine) -> Path:
    return engine.model_info.path


@pytest.mark.parametrize("name,template,tokens,fmt,think", [
    ("llama3", LLAMA3_TEMPLATE, LLAMA3_TOKENS, "llama3_json", None),
    ("harmony", HARMONY_TEMPLATE, HARMONY_TOKENS, "harmony", None),
    ("mistral", "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", ["[TOOL_CALLS]", "[ARGS]"], "mistral", None),
    ("lfm2", "{{ '<|tool_call_start|>' }}", ["<|tool_call_start|>", "<|tool_call_end|>"], "pythonic", None),
    ("qwen3", "{{ '<tool_call>' }}{{ tool_call.name }}", ["<tool_call>", "</tool_call>", "<think>", "</think>"],
     "hermes", THINK),
    ("chatml", None, [], "hermes", None),
])
def test_format_detected_from_the_tokenizer(tmp_path, default_src, name, template, tokens, fmt, think):
    _tokenizer_dir(tmp_path / name, default_src, template, tokens)
    tokenizer = _load_tokenizer(tmp_path / name)
    parser = parser_for(tokenizer)
    assert parser.name == fmt and parser.think == think
    assert parser_for(tokenizer) is parser  # detected once per tokenizer
    if name == "mistral":
        assert parser.tool_format.args_style
    for marker in tokens:
        if marker in parser.tool_format.markers:
            assert marker in parser.tool_format.marker_ids


# -- constrained grammars in each format ------------------------------------------------------------

ALL_MARKERS = sorted({*HARMONY_TOKENS, *LLAMA3_TOKENS, "[TOOL_CALLS]", "[ARGS]", "<|tool_call_start|>",
                      "<|tool_call_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                      "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"})


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory, default_src):
    """The default tokenizer with every format's control tokens added as special tokens."""
    out = tmp_path_factory.mktemp("markers")
    size = _tokenizer_dir(out, default_src, None, ALL_MARKERS)
    return _load_tokenizer(out), size


def _matcher(fmt, tokenizer, size, tool_choice, parallel=None):
    from llguidance import LLMatcher

    from parallm_engine.sampling.constrained import _special_markers, ll_tokenizer, tool_call_grammar

    vocab = tokenizer.get_vocab()
    fmt.marker_ids = {m: vocab[m] for m in fmt.markers if m in vocab}
    grammar = tool_call_grammar(TOOLS, tool_choice, parallel, fmt=fmt, special=_special_markers(fmt, tokenizer, size))
    tok = ll_tokenizer(tokenizer, size)
    assert not LLMatcher.validate_grammar(grammar, tok)
    return LLMatcher(tok, grammar, log_level=0)


def _accepts(matcher, tokenizer, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


# format factory, a valid forced call, its parse, and garbage
GRAMMAR_CASES = {
    "hermes": (HermesFormat, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', UTC,
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "extra": 1}}'),
    "llama3_json": (Llama3JsonFormat, '{"name": "get_weather", "parameters": {"city": "Paris"}}', PARIS,
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    "harmony": (HarmonyFormat, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}<|call|>', PARIS, "<|channel|>final<|message|>It is sunny."),
    "mistral_json": (lambda: MlxLmFormat("mistral"), '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]',
                     UTC, "[TOOL_CALLS]get_time[ARGS]"),
    "mistral_args": (lambda: MlxLmFormat("mistral", "[ARGS]"), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', PARIS,
                     '[TOOL_CALLS][{"name": "get_weather"'),
    "pythonic": (lambda: MlxLmFormat("pythonic"), '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
                 PARIS, "<|tool_call_start|>[get_weather(days=3)]"),
    "kimi_k2": (lambda: MlxLmFormat("kimi_k2"), "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
                '<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|><|tool_calls_section_end|>', UTC,
                "<|tool_calls_section_begin|>get_time"),
    "qwen3_coder": (lambda: MlxLmFormat("qwen3_coder"), "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>", PARIS, "<tool_call>\n<function=send_email>"),
    "glm47": (lambda: MlxLmFormat("glm47"), "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
              "</arg_value>\n</tool_call>", PARIS, "<tool_call>get_weather\n<arg_key>town</arg_key>"),
}


@pytest.mark.parametrize("case", sorted(GRAMMAR_CASES))
def test_required_grammar_accepts_a_valid_call_and_rejects_garbage(case, marker_tokenizer):
    tokenizer, size = marker_tokenizer
    factory, valid, call, garbage = GRAMMAR_CASES[case]
    fmt = factory()
    good = _matcher(fmt, tokenizer, size, "required")
    assert _accepts(good, tokenizer, valid) and good.is_accepting(), good.get_error()
    _, calls = fmt.parse(valid, TOOLS)  # what the grammar forces is what the parser reads
    assert [(c.name, c.arguments) for c in calls] == [call]
    assert not _accepts(_matcher(fmt, tokenizer, size, "required"), tokenizer, garbage)
    assert not _accepts(_matcher(fmt, tokenizer, size, "required"), tokenizer, "Sure, here you go.")
    named = _matcher(fmt, tokenizer, size, {"type": "function", "function": {"name": call[0]}})
    assert _accepts(named, tokenizer, valid) and named.is_accepting()
    other = "get_time" if call[0] == "get_weather" else "get_weather"
    assert not _accepts(_matcher(fmt, tokenizer, size, {"type": "function", "function": {"name": other}}),
                        tokenizer, valid)


UNKNOWN_CALL = {"hermes": '<tool_call>\n{"name": "send_email"', "llama3_json": '{"name": "send_email"',
                "harmony": "<|channel|>commentary to=functions.send_email", "mistral_args": "[TOOL_CALLS]send_email",
                "pythonic": "<|tool_call_start|>[send_email("}


@pytest.mark.parametrize("case", sorted(UNKNOWN_CALL))
def test_auto_grammar_allows_text_or_a_valid_call_and_none_forbids_calls(case, marker_tokenizer):
    tokenizer, size = marker_tokenizer
    factory, valid, _, _ = GRAMMAR_CASES[case]
    garbage = UNKNOWN_CALL[case]
    text = "<|channel|>final<|message|>It is sunny." if case == "harmony" else "It is sunny."
    auto = _matcher(factory(), tokenizer, size, "auto")
    assert _accepts(auto, tokenizer, text) and auto.is_accepting()
    auto = _matcher(factory(), tokenizer, size, "auto")
    assert _accepts(auto, tokenizer, valid) and auto.is_accepting()
    assert not _accepts(_matcher(factory(), tokenizer, size, "auto"), tokenizer, garbage)
    none = _matcher(factory(), tokenizer, size, "none")
    assert _accepts(none, tokenizer, text)
    assert not _accepts(_matcher(factory(), tokenizer, size, "none"), tokenizer, valid)


def test_parallel_calls_grammar(marker_tokenizer):
    tokenizer, size = marker_tokenizer
    two = ('<|tool_call_start|>[get_weather(city="Paris"), get_time(tz="UTC")]<|tool_call_end|>')
    assert _accepts(_matcher(MlxLmFormat("pythonic"), tokenizer, size, "required", True), tokenizer, two)
    assert not _accepts(_matcher(MlxLmFormat("pythonic"), tokenizer, size, "required", False), tokenizer, two)
    two = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}'
    m = _matcher(Llama3JsonFormat(), tokenizer, size, "required", True)
    assert _accepts(m, tokenizer, two) and m.is_accepting()


def test_formats_without_a_grammar_refuse_forced_calls_clearly():
    from parallm_engine import GrammarError
    from parallm_engine.sampling.constrained import tool_call_grammar

    fmt = MlxLmFormat("minimax_m2")
    with pytest.raises(GrammarError, match="minimax_m2"):
        tool_call_grammar(TOOLS, "required", fmt=fmt)


# -- tiny random-weight models in the Llama 3 and gpt-oss formats, through ChatParaLLM -------------


def _tiny_model_dir(out: Path, src: Path, template: str, tokens: list[str], eos: list[str]) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    vocab = _tokenizer_dir(out, src, template, tokens)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "vocab_size": vocab, "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0,
        "eos_token_id": [ids[t] for t in eos],
    }
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, default_src) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny-llama3-tools"), default_src, LLAMA3_TEMPLATE, LLAMA3_TOKENS,
                           ["<|eot_id|>", "<|eom_id|>"])


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, default_src) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny-gpt-oss-tools"), default_src, HARMONY_TEMPLATE,
                           HARMONY_TOKENS, ["<|return|>", "<|call|>"])


def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
    """Current weather in a city."""
    return f"Sunny in {city}"


def get_time(timezone: Literal["UTC", "CET"]) -> str:
    """Current time in a timezone."""
    return "12:00"


def _chat(model_dir: Path):
    from parallm_integrations import ChatParaLLM

    return ChatParaLLM(model=str(model_dir), temperature=0, max_tokens=40)


@pytest.mark.parametrize("family", ["llama3", "harmony"])
def test_bind_tools_required_returns_calls_in_the_family_format(family, llama3_dir, harmony_dir):
    model_dir = llama3_dir if family == "llama3" else harmony_dir
    llm = _chat(model_dir)
    from parallm_engine import get_engine

    engine = get_engine(str(model_dir))
    assert parser_for(engine.tokenizer).name == ("llama3_json" if family == "llama3" else "harmony")
    prompt = engine.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                                        tokenize=False)
    assert ('"parameters"' in prompt) if family == "llama3" else ("namespace functions" in prompt)

    bound = llm.bind_tools([get_weather, get_time], tool_choice="required")
    msg = bound.invoke("What is the weather in Paris?")
    assert msg.tool_calls, msg
    call = msg.tool_calls[0]
    assert call["name"] in ("get_weather", "get_time") and call["type"] == "tool_call"
    assert set(call["args"]) == ({"city"} if call["name"] == "get_weather" else {"timezone"})
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert "<|" not in msg.content and "parameters" not in msg.content

    named = llm.bind_tools([get_weather, get_time], tool_choice="get_time")
    chunks = list(named.stream("What time is it?"))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [c["name"] for c in full.tool_calls] == ["get_time"]
    assert full.tool_calls[0]["args"]["timezone"] in ("UTC", "CET")
    assert named.invoke("What time is it?").tool_calls[0]["args"] == full.tool_calls[0]["args"]


def test_harmony_analysis_is_reasoning_not_answer(harmony_dir):
    """tool_choice auto; the output is forced (a lark grammar over the harmony tokens) to analysis text
    followed by a final answer, then by a call: the analysis never reaches the content."""
    llm = _chat(harmony_dir)
    answer = ('start: <|channel|> "analysis" <|message|> "The user asks about Paris. Think first." <|end|> '
              '<|start|> "assistant" <|channel|> "final" <|message|> "It is sunny."')
    bound = llm.bind_tools([get_weather], tool_choice="auto")
    rf = {"type": "lark", "grammar": answer}
    msg = bound.invoke("Weather in Paris?", response_format=rf)
    assert msg.content == "It is sunny." and not msg.tool_calls
    assert msg.additional_kwargs["reasoning_content"] == "The user asks about Paris. Think first."
    assert msg.content_blocks[0] == {"type": "reasoning", "reasoning": "The user asks about Paris. Think first."}
    assert [b["type"] for b in msg.content_blocks] == ["reasoning", "text"]
    chunks = list(bound.stream("Weather in Paris?", response_format=rf))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == "It is sunny."
    assert full.additional_kwargs["reasoning_content"] == "The user asks about Paris. Think first."

    call = ('start: <|channel|> "analysis" <|message|> "Use the tool." <|end|> <|start|> "assistant" <|channel|> '
            '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Tokyo\\"}" <|call|>')
    msg = bound.invoke("Weather in Tokyo?", response_format={"type": "lark", "grammar": call})
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Tokyo"})]
    assert msg.content == "" and msg.additional_kwargs["reasoning_content"] == "Use the tool."


def test_llama_index_and_server_paths_split_harmony(harmony_dir):
    """The same forced harmony output through LlamaIndex (stream) and the server's response body."""
    from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock

    from parallm_engine import get_engine
    from parallm_engine.serve.openai_format import chat_response
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    grammar = ('start: <|channel|> "analysis" <|message|> "Hmm." <|end|> <|start|> "assistant" <|channel|> '
               '"final" <|message|> "Hello."')
    rf = {"type": "lark", "grammar": grammar}
    li = ParaLLMLlamaIndex(model=str(harmony_dir), temperature=0, max_tokens=30)
    last = None
    for last in li.stream_chat([ChatMessage(role="user", content="Hi")], response_format=rf):
        pass
    assert last.message.content == "Hello."
    assert [b.content for b in last.message.blocks if isinstance(b, ThinkingBlock)] == ["Hmm."]

    engine = get_engine(str(harmony_dir))
    result = engine.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER], response_format=rf,
                         max_tokens=30, temperature=0)
    body = chat_response(result, "tiny", single_call=False)
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello." and message["reasoning_content"] == "Hmm."
