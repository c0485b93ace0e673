"""OpenAI responses -> the client's engine-shaped results (``_remote_types``): whole chat / completions
responses, and a chunk stream re-timed into engine-style deltas (``StreamState``)."""

from __future__ import annotations

import json

from ._remote_types import (
    RemoteChoice,
    RemoteDelta,
    RemoteFinish,
    RemoteReasoning,
    RemoteResult,
    RemoteText,
    RemoteToolCall,
    RemoteToolCallDelta,
    Usage,
)


def _usage(u) -> Usage | None:
    if u is None:
        return None
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    spec = getattr(u, "speculative", None) or {}  # openai's types keep unknown fields as attributes
    if not isinstance(spec, dict):
        spec = getattr(spec, "__dict__", {}) or {}
    timings = _extension(u, "timings")
    out_details = getattr(u, "completion_tokens_details", None)
    reasoning = getattr(out_details, "reasoning_tokens", None) if out_details is not None else None
    return Usage(prompt_tokens=int(u.prompt_tokens or 0), completion_tokens=int(u.completion_tokens or 0),
                 cached_tokens=int(cached or 0), reasoning_tokens=int(reasoning or 0), spec_proposed_tokens=int(spec.get("proposed_tokens") or 0),
                 spec_accepted_tokens=int(spec.get("accepted_tokens") or 0),
                 **{k: float(timings.get(k) or 0.0) for k in ("queue_s", "prefill_s", "decode_s")})


def _extension(u, name: str) -> dict:
    """A ParaLLM ``usage`` extension object (``timings``) as a dict; {} when the server sent none."""
    value = getattr(u, name, None) or {}  # openai's types keep unknown fields as attributes (or dicts)
    if not isinstance(value, dict):
        value = getattr(value, "__dict__", {}) or {}
    return value if all(isinstance(v, (int, float)) for v in value.values()) else {}


#: The error of a call a server sent with finish_reason "length" whose arguments are not whole (as
#: ``parallm_engine.formats.typed_output.TRUNCATED_CALL`` says it in-process).
TRUNCATED_CALL = "the tool call was cut off by max_tokens (finish_reason 'length') before it was complete"


def _tool_call(tc, truncated: bool = False) -> RemoteToolCall:
    """A call of a server's message; ``truncated``: the last call of a message cut off by max_tokens."""
    fn = tc.function
    raw = fn.arguments if fn is not None else ""
    args: dict = {}
    error = None
    if truncated and not (raw or "").strip():
        return RemoteToolCall(id=tc.id or "", name=(fn.name if fn is not None else "") or "", arguments={},
                              raw_arguments=raw, error=TRUNCATED_CALL)
    try:
        parsed = json.loads(raw) if raw else {}
        if isinstance(parsed, dict):
            args = parsed
        else:
            error = "arguments are not a JSON object"
    except (json.JSONDecodeError, TypeError) as exc:
        error = TRUNCATED_CALL if truncated else f"arguments are not valid JSON: {exc}"
    return RemoteToolCall(id=tc.id or "", name=(fn.name if fn is not None else "") or "", arguments=args,
                          raw_arguments=raw, error=error)


def _chat_logprobs(lp) -> dict | None:
    """The server's chat ``logprobs``, as it sent them (OpenAI's shape)."""
    content = getattr(lp, "content", None) if lp is not None else None
    if not content:
        return None
    return {"content": [t.model_dump() for t in content]}


def _completion_logprobs(lp) -> dict | None:
    """A completions response's ``logprobs`` (tokens / token_logprobs / top_logprobs lists), in the chat
    shape every ParaLLM class reports (values as the server sent them)."""
    if lp is None or not lp.tokens:
        return None
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    values = lp.token_logprobs or [None] * len(lp.tokens)
    return {"content": [
        {"token": tok, "logprob": val, "bytes": list(tok.encode("utf-8")),
         "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode("utf-8"))} for k, v in (top or {}).items()]}
        for tok, val, top in zip(lp.tokens, values, tops)
    ]}


def _reasoning(message) -> str | None:
    """A message's or delta's reasoning text: ``reasoning_content`` (vLLM, DeepSeek, ``parallm serve``) or
    ``reasoning`` (newer vLLM); openai's types keep such extra fields as attributes."""
    if message is None:
        return None
    return getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None) or None


def _chat_result(resp) -> RemoteResult:
    choices = []
    for ch in sorted(resp.choices, key=lambda c: c.index):
        msg = ch.message
        content = msg.content or ""
        calls = list(msg.tool_calls or [])
        cut = ch.finish_reason == "length"
        choices.append(RemoteChoice(index=ch.index, text=content, finish_reason=ch.finish_reason,
                                    logprobs=_chat_logprobs(ch.logprobs), content=content,
                                    tool_calls=[_tool_call(tc, cut and i == len(calls) - 1)
                                                for i, tc in enumerate(calls)],
                                    reasoning=_reasoning(msg)))
    return RemoteResult(request_id=resp.id, choices=choices, usage=_usage(resp.usage) or Usage(), model=resp.model,
                        system_fingerprint=getattr(resp, "system_fingerprint", None) or None)


def _completion_results(resp, n_prompts: int, n: int) -> list[RemoteResult]:
    """One HTTP response for many prompts -> one result per prompt (choice i*n + j is prompt i's j-th)."""
    groups: list[list[RemoteChoice]] = [[] for _ in range(n_prompts)]
    for ch in sorted(resp.choices, key=lambda c: c.index):
        p, j = divmod(ch.index, n)
        if p < n_prompts:
            groups[p].append(RemoteChoice(index=j, text=ch.text, finish_reason=ch.finish_reason,
                                          logprobs=_completion_logprobs(ch.logprobs), content=ch.text))
    usage = _usage(resp.usage) or Usage()
    results = []
    for i, choices in enumerate(groups):
        # The server reports usage for the whole call: it goes on the first result, so sums stay right; its
        # timings (the call's) on every result.
        rest = Usage(**usage.timings_dict())
        results.append(RemoteResult(request_id=f"{resp.id}-{i}", choices=choices,
                                    usage=usage if i == 0 else rest, model=resp.model))
    return results


class _StreamState:
    """Re-times an OpenAI chunk stream into engine-style deltas: ``usage`` (a chunk of its own at the
    end of an OpenAI stream, or, from servers that report it continuously, on every chunk) goes onto
    the request's very last delta, the last one that carries a ``finish_reason``."""

    def __init__(self) -> None:
        self.pending: RemoteDelta | None = None
        self.model: str | None = None
        self.usage: Usage | None = None
        self.request_id = ""

    def feed(self, chunk, completion: bool) -> list[RemoteDelta]:
        self.model = getattr(chunk, "model", None) or self.model
        self.request_id = getattr(chunk, "id", None) or self.request_id
        self.fingerprint = getattr(chunk, "system_fingerprint", None) or getattr(self, "fingerprint", None)
        usage = _usage(getattr(chunk, "usage", None))
        if usage is not None:
            self.usage = usage
        out: list[RemoteDelta] = []
        for ch in chunk.choices or []:
            if completion:
                delta = RemoteDelta(chunk.id, ch.index, ch.text or "", finish_reason=ch.finish_reason,
                                    logprobs=_completion_logprobs(ch.logprobs))
            else:
                d = ch.delta
                calls = []
                for tc in (getattr(d, "tool_calls", None) or []):
                    fn = tc.function
                    calls.append(RemoteToolCallDelta(tc.index, tc.id or None, (fn.name if fn else None) or None,
                                                     (fn.arguments if fn else "") or ""))
                delta = RemoteDelta(chunk.id, ch.index, (d.content if d is not None else None) or "",
                                    finish_reason=ch.finish_reason, logprobs=_chat_logprobs(ch.logprobs),
                                    tool_calls=calls, reasoning=_reasoning(d))
            if not (delta.text or delta.tool_calls or delta.logprobs or delta.finish_reason or delta.reasoning):
                continue  # e.g. the role-only first chunk
            delta.pieces = [*([RemoteReasoning(delta.reasoning)] if delta.reasoning else []), *delta.tool_calls,
                            *([RemoteText(delta.text)] if delta.text else []),
                            *([RemoteFinish(delta.finish_reason)] if delta.finish_reason else [])]
            delta.model = self.model
            delta.system_fingerprint = self.fingerprint
            if self.pending is not None:
                out.append(self.pending)
                self.pending = None
            if delta.finish_reason is not None:
                self.pending = delta  # maybe the last one: usage may still come
            else:
                out.append(delta)
        return out

    def flush(self) -> list[RemoteDelta]:
        """At the end of the stream."""
        last, self.pending = self.pending, None
        if last is not None:
            last.usage = self.usage
            return [last]
        if self.usage is not None:
            return [RemoteDelta(self.request_id, 0, "", usage=self.usage, model=self.model)]
        return []
