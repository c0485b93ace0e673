"""Stream deltas as LangChain ``ChatGenerationChunk``s: one builder (:class:`_ChunkBuilder`) maps typed pieces,
the in-process engine's own or those :class:`_ChatChunks` makes of a server's ``RemoteDelta``s; the stream ends
with one last chunk that carries usage, finish reason, model name and id (``chunk_position="last"``), and adds
up to what ``invoke`` returns on the same path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from ._lc_results import cut_call_args, response_metadata
from ._messages import logprobs_to_openai, usage_metadata


class _ChunkBuilder:
    """Turns one request's deltas into ``ChatGenerationChunk``s by mapping typed pieces (the engine's
    ``StreamDelta.pieces``, ``parallm_engine.formats.typed_output``; :class:`_ChatChunks` makes the same pieces
    of a server's deltas): content, reasoning, ``tool_call_chunks``; usage / finish reason / model name / id
    exactly once, on the last chunk (``chunk_position="last"``). Nothing is parsed here, so the chunks add up
    to what ``invoke`` returns."""

    def __init__(self, model_name: str, parallel_tool_calls: bool | None):
        self.model_name = model_name
        self.single_call = parallel_tool_calls is False
        self.finish_reason: str | None = None
        self.usage = None
        self.request_id: str | None = None
        self.fingerprint: str | None = None
        self.saw_call = False
        self.call_args: dict[int, str] = {}  # each reported call's argument text so far
        self.last_call = -1  # the index of the last call, reported or not: the one max_tokens may cut

    @staticmethod
    def _content(text: str, logprobs=None) -> ChatGenerationChunk:
        info = {"logprobs": logprobs} if logprobs else None
        msg = AIMessageChunk(content=text, response_metadata=dict(info) if info else {})
        return ChatGenerationChunk(message=msg, generation_info=info)

    def _pieces(self, pieces, logprobs=None) -> Iterator[ChatGenerationChunk]:
        """Chunks of ``pieces`` in order; ``logprobs`` (OpenAI's form) ride on the last content piece, or on
        an empty one after the others."""
        pieces = list(pieces)
        last_text = max((i for i, ev in enumerate(pieces) if _is_content(ev)), default=None)
        for i, ev in enumerate(pieces):
            if hasattr(ev, "arguments_delta"):  # ToolCallDelta: a call starts (id, name) or its arguments grow
                self.last_call = max(self.last_call, ev.index)
                if self.single_call and ev.index > 0:
                    continue
                self.saw_call = True
                self.call_args[ev.index] = self.call_args.get(ev.index, "") + (ev.arguments_delta or "")
                yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
                    name=ev.name or None, args=ev.arguments_delta or "", id=ev.id or None,
                    index=ev.index)]))
            elif getattr(ev, "reasoning", ""):  # ReasoningDelta: never part of the answer
                yield ChatGenerationChunk(
                    message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": ev.reasoning})
                )
            elif hasattr(ev, "calls"):  # Finish: the finish reason as the engine decided it
                self.finish_reason = ev.reason
            elif _is_content(ev):
                yield self._content(ev.text, logprobs if i == last_text else None)
        if logprobs and last_text is None:
            yield self._content("", logprobs)

    def feed(self, delta) -> Iterator[ChatGenerationChunk]:
        self.request_id = self.request_id or getattr(delta, "request_id", None)
        if delta.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage
        yield from self._pieces(delta.pieces, logprobs_to_openai(delta.logprobs))

    def _finish_reason(self, result=None) -> str | None:
        return self.finish_reason or getattr(result, "finish_reason", None)

    def _model_name(self) -> str:
        return self.model_name

    def _cut_call_chunks(self, finish_reason: str | None) -> list:
        """The piece that makes a call max_tokens cut off add up to an invalid call, as ``invoke`` reports it
        (:func:`~._lc_results.cut_call_args`): the last call of a "length" finish whose arguments are not
        whole (as the engine and the server client decide it: not a JSON object, or none at all)."""
        raw = self.call_args.get(self.last_call)
        if finish_reason != "length" or raw is None or _whole_arguments(raw):
            return []
        return [tool_call_chunk(name=None, args=cut_call_args(raw)[len(raw):], id=None, index=self.last_call)]

    def finish(self, result=None) -> Iterator[ChatGenerationChunk]:
        usage = self.usage if self.usage is not None else getattr(result, "usage", None)
        finish_reason = self._finish_reason(result)
        meta = response_metadata(finish_reason, self._model_name(), self.request_id, usage, self.fingerprint)
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="", usage_metadata=usage_metadata(usage), response_metadata=meta, chunk_position="last",
                tool_call_chunks=self._cut_call_chunks(finish_reason),
            ),
            generation_info={"finish_reason": finish_reason},
        )


def _whole_arguments(raw: str) -> bool:
    try:
        return bool(raw.strip()) and isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def _is_content(ev) -> bool:
    return bool(getattr(ev, "text", "")) and not hasattr(ev, "arguments_delta") and not hasattr(ev, "calls")


class _Piece:
    """A typed piece made of a server's delta field (duck-typed as ``chat_format``'s)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class _ChatChunks(_ChunkBuilder):
    """A server's ``RemoteDelta``s as the same typed pieces (reasoning, tool-call deltas as the server sent
    them, text), through the one builder; plus the server's model name and system fingerprint."""

    def __init__(self, params: dict[str, Any]):
        super().__init__(str(params.get("model")), params.get("parallel_tool_calls"))
        self.model: str | None = None

    def feed(self, delta) -> Iterator[ChatGenerationChunk]:
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage
        self.model = delta.model or self.model
        self.request_id = self.request_id or delta.request_id or None
        self.fingerprint = delta.system_fingerprint or self.fingerprint
        pieces = [_Piece(reasoning=delta.reasoning)] if delta.reasoning else []
        pieces += [_Piece(index=ev.index, id=ev.id, name=ev.name, arguments_delta=ev.arguments_delta)
                   for ev in delta.tool_calls]
        if delta.text:
            pieces.append(_Piece(text=delta.text))
        yield from self._pieces(pieces, logprobs_to_openai(delta.logprobs))

    def _finish_reason(self, result=None) -> str | None:
        # a server that streamed calls but said "stop" (an OpenAI-compatible server of another kind)
        return "tool_calls" if self.saw_call and self.finish_reason == "stop" else self.finish_reason

    def _model_name(self) -> str:
        return self.model or self.model_name  # the model the server says answered


__all__ = ["_ChatChunks", "_ChunkBuilder"]
