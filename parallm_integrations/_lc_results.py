"""Finished results as LangChain objects, the same for the in-process engine's results and a server's
(``base_url=``): ``ChatResult`` / ``ChatGeneration`` with ``AIMessage`` (content, tool calls, reasoning,
usage, ``response_metadata`` as ``ChatOpenAI`` users read it), ``LLMResult`` and the text chunks of ``ParaLLM``.
"""

from __future__ import annotations

from typing import Any

PROVIDER = "parallm"


def cut_call_args(raw: str) -> str:
    """The argument text LangChain gets for a call cut off by max_tokens, in ``invoke`` and in a stream alike:
    the partial text as generated, then what makes it never parse as arguments: a quote closing a string left
    open, and a bracket that closes nothing (``'{"city": "Par'`` -> ``'{"city": "Par"]'``).

    Why: a stream's chunks become calls when they are added up, through ``parse_partial_json``, which
    completes any JSON prefix (or empty text) into a dict, so a partial call would add up to a valid-looking
    ``tool_calls`` entry (``{"name": "get_", "args": {}}``). At a mismatched closing bracket it gives up, and
    the call lands in ``invalid_tool_calls`` as ``invoke`` reports it. The walk below mirrors its scan."""
    stack: list[str] = []
    in_string = escaped = False
    for char in raw:
        if in_string:
            if char == '"' and not escaped:
                in_string = False
            elif char == "\\":
                escaped = not escaped
            else:
                escaped = False
        elif char == '"':
            in_string, escaped = True, False
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            if not stack or stack[-1] != char:
                return raw  # already mismatched: it never parses
            stack.pop()
    close = ('""' if escaped else '"') if in_string else ""  # an escaped quote, then the closing one
    return raw + close + ("}" if stack and stack[-1] == "]" else "]")


def is_cut_call(error: str | None) -> bool:
    """Whether a call's ``error`` says max_tokens cut it off (the engine and the server client say it alike)."""
    from ._remote_responses import TRUNCATED_CALL

    return error == TRUNCATED_CALL


def langchain_tool_calls(calls, single_call: bool = False) -> tuple[list[dict], list[dict]]:
    """The tool calls the engine parsed (in-process ``Choice.tool_calls``; through a server, the calls it
    sent, ``RemoteToolCall``) as LangChain ``(tool_calls, invalid_tool_calls)``, the same way on both paths:
    a call with an ``error`` (its arguments are not a JSON object) is an invalid call that keeps the raw
    argument text; a call cut off by max_tokens keeps it as :func:`cut_call_args` makes it, as a stream's
    chunks add up to. ``single_call`` (``parallel_tool_calls=False``) keeps the first call only."""
    from langchain_core.messages.tool import invalid_tool_call, tool_call

    calls = list(calls or [])
    if single_call:
        calls = calls[:1]
    valid, invalid = [], []
    for c in calls:
        error = getattr(c, "error", None)
        if error:
            args = getattr(c, "raw_arguments", None)
            if is_cut_call(error):
                args = cut_call_args(args or "")
            # no name (cut off before it) is None, as a stream's chunks carry it
            invalid.append(invalid_tool_call(name=c.name or None, args=args, id=c.id, error=error))
        else:
            valid.append(tool_call(name=c.name, args=dict(c.arguments), id=c.id))
    return valid, invalid


def response_metadata(finish_reason, model_name: str, request_id: str | None, usage,
                      system_fingerprint: str | None = None) -> dict[str, Any]:
    """``response_metadata`` as ``ChatOpenAI`` users read it: ``finish_reason``, ``model_name``, the response
    ``id`` (a server's own id with ``base_url``), ``token_usage`` (OpenAI's usage dict) and
    ``system_fingerprint`` when the server sent one; plus ``model_provider``, and the call's seconds in the
    engine's queue, prefill and decode (``queue_s``, ``prefill_s``, ``decode_s``) and ``cached_tokens``."""
    from ._messages import call_timings, token_usage_dict

    meta: dict[str, Any] = {"finish_reason": finish_reason, "model_name": model_name, "model_provider": PROVIDER}
    if request_id:
        meta["id"] = request_id
    if usage is not None:
        meta["token_usage"] = token_usage_dict(usage)
        meta.update(call_timings(usage))
    if system_fingerprint:
        meta["system_fingerprint"] = system_fingerprint
    return meta


def chat_generation(choice, usage, model_name: str, single_call: bool = False, request_id: str | None = None,
                    system_fingerprint: str | None = None):
    """A finished choice (the engine's ``Choice`` or a server's ``RemoteChoice``) as a ``ChatGeneration``:
    the content without tool-call markup, the calls, ``finish_reason`` ("tool_calls" when it made calls),
    model name, logprobs and usage."""
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration

    from ._messages import logprobs_to_openai, usage_metadata

    tool_calls, invalid = langchain_tool_calls(choice.tool_calls, single_call)
    finish_reason = choice.finish_reason
    if (tool_calls or invalid) and finish_reason == "stop":
        finish_reason = "tool_calls"
    meta = response_metadata(finish_reason, model_name, request_id, usage, system_fingerprint)
    info: dict[str, Any] = {"finish_reason": finish_reason}
    logprobs = logprobs_to_openai(choice.logprobs)
    if logprobs:
        meta["logprobs"] = info["logprobs"] = logprobs
    content = choice.content if choice.content is not None else choice.text
    reasoning = getattr(choice, "reasoning", None)  # <think> / harmony analysis: never in the content
    message = AIMessage(content=content or "", tool_calls=tool_calls, invalid_tool_calls=invalid,
                        additional_kwargs={"reasoning_content": reasoning} if reasoning else {},
                        usage_metadata=usage_metadata(usage), response_metadata=meta)
    return ChatGeneration(message=message, generation_info=info)


def chat_result(result, model_name: str, single_call: bool = False):
    """A finished request (every choice) as a LangChain ``ChatResult``."""
    from langchain_core.outputs import ChatResult

    from ._messages import token_usage_dict

    rid, fingerprint = getattr(result, "request_id", None), getattr(result, "system_fingerprint", None)
    llm_output: dict[str, Any] = {"model_name": model_name, "model_provider": PROVIDER, "id": rid}
    if result.usage is not None:
        llm_output["token_usage"] = token_usage_dict(result.usage)
    if fingerprint:
        llm_output["system_fingerprint"] = fingerprint
    return ChatResult(
        generations=[chat_generation(c, result.usage, model_name, single_call, rid, fingerprint)
                     for c in result.choices],
        llm_output=llm_output,
    )


def combine_llm_outputs(outputs: list[dict | None]) -> dict[str, Any]:
    """``llm_output`` of several results (``generate`` over many conversations): token usage summed, as
    ``ChatOpenAI`` does."""
    outputs = [o for o in outputs if o]
    if not outputs:
        return {}
    total: dict[str, Any] = {}
    for o in outputs:
        for key, value in (o.get("token_usage") or {}).items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value
            elif key == "prompt_tokens_details" and isinstance(value, dict):
                cached = total.setdefault(key, {"cached_tokens": 0})
                cached["cached_tokens"] += int(value.get("cached_tokens") or 0)
    combined = {"model_name": outputs[0].get("model_name"), "model_provider": PROVIDER}
    if total:
        combined["token_usage"] = total
    return combined



# -- ParaLLM (text completion) ----------------------------------------------------------------------


def sum_usage(results) -> dict[str, Any]:
    """Token usage of several results, summed (OpenAI's shape)."""
    prompt = completion = cached = 0
    for r in results:
        prompt += int(r.usage.prompt_tokens)
        completion += int(r.usage.completion_tokens)
        cached += int(r.usage.cached_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def llm_result(results, model_name: str):
    """Finished text requests (one per prompt, every choice) as a LangChain ``LLMResult``."""
    from langchain_core.outputs import Generation, LLMResult

    from ._messages import call_timings, logprobs_to_openai

    generations = []
    for result in results:
        gens = []
        for choice in result.choices:
            info: dict[str, Any] = {"finish_reason": choice.finish_reason, **call_timings(result.usage)}
            logprobs = logprobs_to_openai(choice.logprobs)
            if logprobs:
                info["logprobs"] = logprobs
            gens.append(Generation(text=choice.text, generation_info=info))
        generations.append(gens)
    return LLMResult(generations=generations,
                     llm_output={"token_usage": sum_usage(results), "model_name": model_name,
                                 "model_provider": PROVIDER})


def text_chunk(delta):
    """A text delta as a ``GenerationChunk`` (None when it carries neither text nor logprobs)."""
    from langchain_core.outputs import GenerationChunk

    from ._messages import logprobs_to_openai

    logprobs = logprobs_to_openai(delta.logprobs)
    if not delta.text and not logprobs:
        return None
    return GenerationChunk(text=delta.text, generation_info={"logprobs": logprobs} if logprobs else None)


def final_text_chunk(model_name: str, finish_reason: str | None, usage):
    """A text stream's last chunk: finish reason, model name, usage and the call's timings."""
    from langchain_core.outputs import GenerationChunk

    from ._messages import call_timings, token_usage_dict

    info: dict[str, Any] = {"finish_reason": finish_reason, "model_name": model_name, "model_provider": PROVIDER}
    if usage is not None:
        info["token_usage"] = token_usage_dict(usage)
        info.update(call_timings(usage))
    return GenerationChunk(text="", generation_info=info)
