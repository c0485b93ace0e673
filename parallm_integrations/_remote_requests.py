"""Request bodies of the ``base_url=`` client: engine keyword names -> the ``openai`` client's arguments
(OpenAI's own fields as themselves, the others in ``extra_body``, as vLLM and SGLang read them)."""

from __future__ import annotations

from typing import Any

#: Request fields the OpenAI API has for each endpoint; everything else goes in ``extra_body``.
_CHAT_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "user", "metadata",
})
_COMPLETION_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "echo", "user", "best_of", "suffix",
})


def _split(body: dict[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    """OpenAI fields as keyword arguments; the rest in ``extra_body``; None values dropped."""
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        (kwargs if key in allowed else extra)[key] = value
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {str(k): v for k, v in kwargs["logit_bias"].items()}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def _chat_kwargs(messages: list[dict], model: str, tools, tool_choice, response_format, parallel_tool_calls,
                 sampling: dict[str, Any]) -> dict[str, Any]:
    body = dict(sampling)
    if "session" in body:  # the server reads a session from OpenAI's user field
        body["user"] = body.pop("session")
    if body.get("top_logprobs") and not body.get("logprobs"):
        body["logprobs"] = True
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    if tools:
        body["tools"] = list(tools)
        if tool_choice is not None:
            body["tool_choice"] = "required" if tool_choice in ("any", True) else tool_choice
        if parallel_tool_calls is not None:
            body["parallel_tool_calls"] = parallel_tool_calls
    if response_format is not None:
        body["response_format"] = response_format
    kwargs = _split(body, _CHAT_FIELDS)
    kwargs["model"] = model
    kwargs["messages"] = messages
    return kwargs


#: Most sequences (prompts x n) one completions request carries: ``parallm serve`` refuses a request over
#: a quarter of its queue (256 of the default 1,024) with 400 ``too_many_sequences``, and vLLM's server
#: has no such cap; larger batches go as several concurrent requests.
MAX_SEQUENCES_PER_REQUEST = 64


def _prompt_chunks(prompts: list[str], n: int) -> list[list[str]]:
    size = max(1, MAX_SEQUENCES_PER_REQUEST // max(1, n))
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def _completion_kwargs(prompt, model: str, response_format, sampling: dict[str, Any]) -> dict[str, Any]:
    body = dict(sampling)
    if "session" in body:
        body["user"] = body.pop("session")
    want = body.pop("logprobs", None)
    top = body.pop("top_logprobs", None)
    if want or top:
        body["logprobs"] = int(top or 0)  # the completions API takes the number of alternatives
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    if response_format is not None:
        body["response_format"] = response_format  # ParaLLM / vLLM extension: goes in extra_body
    kwargs = _split(body, _COMPLETION_FIELDS)
    kwargs["model"] = model
    kwargs["prompt"] = prompt
    return kwargs
