"""Stream deltas as LangChain ``ChatGenerationChunk``s: the in-process engine's (:class:`_ChunkBuilder`, from the
engine's typed pieces) and a server's (:class:`_ChatChunks`, from ``RemoteDelta``s); both end with one last
chunk that carries usage, finish reason, model name and id (``chunk_position="last"``), and add up to what
``invoke`` returns on the same path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from ._lc_results import response_metadata
from ._messages import logprobs_to_openai, usage_metadata


class _ChunkBuilder:
    """Turns one request's engine deltas into ``ChatGenerationChunk``s by mapping the engine's typed pieces
    (``StreamDelta.pieces``, ``parallm_engine.formats.typed_output``): content, reasoning, ``tool_call_chunks``;
    usage / finish reason / model name / id exactly once, on the last chunk (``chunk_position="last"``).
    Nothing is parsed here, so the chunks add up to what ``invoke`` returns."""

    def __init__(self, model_name: str, parallel_tool_calls: bool | None):
        self.model_name = model_name
        self.single_call = parallel_tool_calls is False
        self.finish_reason: str | None = None
        self.usage = None
        self.request_id: str | None = None
        self.saw_call = False

    def _content(self, text: str, logprobs=None) -> ChatGenerationChunk:
        info = {"logprobs": logprobs} if logprobs else None
        msg = AIMessageChunk(content=text, response_metadata=dict(info) if info else {})
        return ChatGenerationChunk(message=msg, generation_info=info)

    def _pieces(self, pieces) -> Iterator[ChatGenerationChunk]:
        for ev in pieces:
            if hasattr(ev, "arguments_delta"):  # ToolCallDelta: a call starts (id, name) or its arguments grow
                if self.single_call and ev.index > 0:
                    continue
                self.saw_call = True
                yield ChatGenerationChunk(
                    message=AIMessageChunk(
                        content="",
                        tool_call_chunks=[
                            tool_call_chunk(
                                name=ev.name if ev.id is not None else None, args=ev.arguments_delta or "",
                                id=ev.id or None, index=ev.index,
                            )
                        ],
                    )
                )
            elif getattr(ev, "reasoning", ""):  # ReasoningDelta: never part of the answer
                yield ChatGenerationChunk(
                    message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": ev.reasoning})
                )
            elif hasattr(ev, "calls"):  # Finish: the finish reason as the engine decided it
                self.finish_reason = ev.reason
            elif getattr(ev, "text", ""):
                yield self._content(ev.text)

    def feed(self, delta) -> Iterator[ChatGenerationChunk]:
        self.request_id = self.request_id or getattr(delta, "request_id", None)
        if delta.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage
        yield from self._pieces(delta.pieces)
        logprobs = logprobs_to_openai(delta.logprobs)
        if logprobs:
            yield self._content("", logprobs)

    def finish(self, result=None) -> Iterator[ChatGenerationChunk]:
        usage = self.usage if self.usage is not None else getattr(result, "usage", None)
        finish_reason = self.finish_reason or getattr(result, "finish_reason", None)
        meta = response_metadata(finish_reason, self.model_name, self.request_id, usage)
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="", usage_metadata=usage_metadata(usage), response_metadata=meta, chunk_position="last"
            ),
            generation_info={"finish_reason": finish_reason},
        )


class _ChatChunks:
    """RemoteDelta -> ChatGenerationChunk, as the in-process ``_ChunkBuilder`` builds them."""

    def __init__(self, params: dict[str, Any]):
        self.model_name = str(params.get("model"))
        self.single_call = params.get("parallel_tool_calls") is False
        self.finish_reason: str | None = None
        self.usage = None
        self.saw_call = False
        self.model: str | None = None
        self.request_id: str | None = None
        self.fingerprint: str | None = None

    def feed(self, delta) -> Iterator[ChatGenerationChunk]:
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage
        self.model = delta.model or self.model
        self.request_id = self.request_id or delta.request_id or None
        self.fingerprint = delta.system_fingerprint or self.fingerprint
        if delta.reasoning:  # never part of the answer (as the in-process _ChunkBuilder does)
            yield ChatGenerationChunk(message=AIMessageChunk(content="",
                                                             additional_kwargs={"reasoning_content": delta.reasoning}))
        for ev in delta.tool_calls:
            if self.single_call and ev.index > 0:
                continue
            self.saw_call = True
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
                name=ev.name or None, args=ev.arguments_delta or "", id=ev.id or None, index=ev.index)]))
        logprobs = logprobs_to_openai(delta.logprobs)
        if delta.text or logprobs:
            info = {"logprobs": logprobs} if logprobs else None
            msg = AIMessageChunk(content=delta.text, response_metadata=dict(info) if info else {})
            yield ChatGenerationChunk(message=msg, generation_info=info)

    def finish(self) -> Iterator[ChatGenerationChunk]:
        finish_reason = self.finish_reason
        if self.saw_call and finish_reason == "stop":
            finish_reason = "tool_calls"
        meta = response_metadata(finish_reason, self.model or self.model_name, self.request_id, self.usage,
                                 self.fingerprint)
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage_metadata(self.usage), response_metadata=meta,
                                   chunk_position="last"),
            generation_info={"finish_reason": finish_reason},
        )


__all__ = ["_ChatChunks", "_ChunkBuilder"]
