"""Where a ``ParaLLMLlamaIndex`` request runs: the shared in-process engine, or an OpenAI-compatible server
(``base_url``: ``parallm serve``, vLLM, SGLang, mlx-lm's server) through ``_remote``'s ``RemoteClient``.

Both take the same input and give the engine's result shapes, so ``ParaLLMLlamaIndex`` builds requests
and responses once (``_responses``). A *prompt* is either

* a list of OpenAI message dicts, rendered with the model's chat template (by the engine in-process, by
  the server on ``/v1/chat/completions``, which also parses tool calls and applies ``tool_choice``), or
* a string: raw text the model continues (``/v1/completions`` remotely).

::

    backend.model_name                      -> str (the name results are reported under, when they carry none)
    backend.run(prompt, req)                -> GenerationResult            (its first choice is the answer)
    await backend.arun(prompt, req)         -> GenerationResult
    backend.stream(prompt, req)             -> Iterator[StreamDelta]       (closing it aborts the request)
    backend.astream(prompt, req)            -> AsyncIterator[StreamDelta]  (so does aclose())
    backend.tool_markup_in_text             -> True: tool calls come inside the deltas' text, to be parsed
                                               (in-process); False: as ``RemoteDelta.tool_calls``

``req`` is a ``_common.EngineRequest``: sampling settings (engine names), ``tools`` (OpenAI dicts, as
shown to the model), ``engine_tools`` (the closed schemas in-process decoding is constrained to),
``tool_choice``, ``parallel_tool_calls``, ``response_format`` and ``timeout``.

The request is submitted (or sent) when a stream is first iterated, not when it is created, so a stream
that is never iterated costs nothing; its prompt is rendered up front, so a bad message fails at the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from parallm_integrations._common import DEFAULT_MODEL_NAME, EngineCall, EngineRequest, is_default_model


class EngineBackend:
    """The shared in-process engine."""

    tool_markup_in_text = True

    def __init__(self, engine: Any, allow_special_tokens: bool = False):
        self.engine = engine
        self.allow_special_tokens = allow_special_tokens  # parse special-token text in messages (trusted only)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def output_parser(self):
        """The model family's tool-call / reasoning format, to split the raw text of stream deltas."""
        from parallm_engine.chat_format import parser_for

        return parser_for(getattr(self.engine, "tokenizer", None))

    def _engine_prompt(self, prompt: list[dict[str, Any]] | str, req: EngineRequest) -> list[int] | str:
        if isinstance(prompt, str):
            return prompt
        if any(isinstance(m.get("content"), list) for m in prompt):  # images: a vision-language prompt
            from parallm_engine.vision_chat import chat_prompt

            return chat_prompt(self.engine, prompt, req.tools, {})
        return self.engine.apply_chat_template(prompt, tools=req.tools, allow_special_tokens=self.allow_special_tokens)

    async def _aengine_prompt(self, prompt: list[dict[str, Any]] | str, req: EngineRequest):
        """:meth:`_engine_prompt` for the async paths: a chat with images is prepared on a worker thread
        (decoding, hashing, the image processor), never on the event loop."""
        if not isinstance(prompt, str) and any(isinstance(m.get("content"), list) for m in prompt):
            return await asyncio.to_thread(self._engine_prompt, prompt, req)
        return self._engine_prompt(prompt, req)

    def run(self, prompt: list[dict[str, Any]] | str, req: EngineRequest):
        call = EngineCall(self.engine, self._engine_prompt(prompt, req), req)
        for _ in call:
            pass
        return call.result

    async def arun(self, prompt: list[dict[str, Any]] | str, req: EngineRequest):
        engine_prompt = await self._aengine_prompt(prompt, req)
        call = EngineCall(self.engine, engine_prompt, req, loop=asyncio.get_running_loop())
        async for _ in call:  # a cancelled caller aborts the request (EngineCall's finally)
            pass
        return call.result

    def stream(self, prompt: list[dict[str, Any]] | str, req: EngineRequest) -> Iterator[Any]:
        engine_prompt = self._engine_prompt(prompt, req)

        def gen() -> Iterator[Any]:
            yield from EngineCall(self.engine, engine_prompt, req)  # closing aborts (EngineCall's finally)

        return gen()

    def astream(self, prompt: list[dict[str, Any]] | str, req: EngineRequest) -> AsyncIterator[Any]:
        has_parts = not isinstance(prompt, str) and any(isinstance(m.get("content"), list) for m in prompt)
        engine_prompt = None if has_parts else self._engine_prompt(prompt, req)

        async def gen() -> AsyncIterator[Any]:
            nonlocal engine_prompt
            if engine_prompt is None:  # images: prepared off the event loop when iteration starts
                engine_prompt = await self._aengine_prompt(prompt, req)
            it = EngineCall(self.engine, engine_prompt, req, loop=asyncio.get_running_loop()).__aiter__()
            try:
                async for delta in it:
                    yield delta
            finally:
                await it.aclose()  # aborts the request if the consumer stopped early

        return gen()


class RemoteBackend:
    """An OpenAI-compatible server, through the process-wide ``RemoteClient`` for its URL and key.

    Errors are the engine's (``InvalidRequestError`` / ``ContextLengthExceededError`` for a 400,
    ``QueueFullError`` for a 429, ``ModelLoadError`` for an unknown model, ``TimeoutError``); others
    (401, 5xx, an unreachable server) are the ``openai`` exceptions, after ``max_retries`` retries."""

    tool_markup_in_text = False

    def __init__(self, client: Any, model: str | None, allow_special_tokens: bool = False):
        self.client = client
        self.model = model
        self.allow_special_tokens = allow_special_tokens

    @property
    def model_name(self) -> str:
        return DEFAULT_MODEL_NAME if is_default_model(self.model) else str(self.model)

    def _kwargs(self, req: EngineRequest, chat: bool) -> dict[str, Any]:
        kw = dict(req.sampling)
        adapter = kw.pop("adapter", None)  # a server serves its LoRA adapters as models (vLLM's convention)
        kw["model"] = adapter or kw.pop("model", None) or self.model  # None / the default's name: the server's model
        if req.timeout is not None:
            kw["timeout"] = req.timeout
        if req.response_format is not None:
            kw["response_format"] = req.response_format
        if chat and self.allow_special_tokens:  # a ParaLLM extension, sent only when not the default
            kw["allow_special_tokens"] = True
        if chat and req.tools:
            # The tools as shown to the model; the server constrains decoding itself (parallm serve closes
            # the argument schemas as the in-process engine does).
            kw["tools"] = req.tools
            kw["tool_choice"] = req.tool_choice
            kw["parallel_tool_calls"] = req.parallel_tool_calls
        return kw

    def run(self, prompt: list[dict[str, Any]] | str, req: EngineRequest):
        if isinstance(prompt, str):
            return self.client.generate(prompt, **self._kwargs(req, chat=False))[0]
        return self.client.chat(prompt, **self._kwargs(req, chat=True))

    async def arun(self, prompt: list[dict[str, Any]] | str, req: EngineRequest):
        if isinstance(prompt, str):
            return (await self.client.agenerate(prompt, **self._kwargs(req, chat=False)))[0]
        return await self.client.achat(prompt, **self._kwargs(req, chat=True))

    def stream(self, prompt: list[dict[str, Any]] | str, req: EngineRequest) -> Iterator[Any]:
        if isinstance(prompt, str):
            return self.client.stream(prompt, **self._kwargs(req, chat=False))
        return self.client.chat_stream(prompt, **self._kwargs(req, chat=True))

    def astream(self, prompt: list[dict[str, Any]] | str, req: EngineRequest) -> AsyncIterator[Any]:
        if isinstance(prompt, str):
            return self.client.astream(prompt, **self._kwargs(req, chat=False))
        return self.client.achat_stream(prompt, **self._kwargs(req, chat=True))


__all__ = ["EngineBackend", "RemoteBackend"]
