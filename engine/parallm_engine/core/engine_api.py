"""The engine's convenience API over ``submit``: tokens and chat templates (``encode``, ``decode``,
``apply_chat_template``), whole results (``generate`` / ``agenerate``, ``chat`` / ``achat``) and streams
(``stream`` / ``astream``, ``chat_stream`` / ``achat_stream``). Mixed into :class:`~parallm_engine.core.engine.Engine`
(as :class:`~parallm_engine.embed.embedding_api.EmbeddingAPI` is), which supplies ``tokenizer``, ``model_info`` and
``submit``; everything here is plain Python over those.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator, Sequence

from parallm_engine.formats.chat_tokens import ChatTokenizer
from parallm_engine.errors import InvalidRequestError
from parallm_engine.core.request import GenerationResult, RequestHandle, StreamDelta
from parallm_engine.core.validation import check_text
from parallm_engine.vision.vlm import VisionPrompt
from parallm_engine.vision.chat import achat_prompt, achat_stream, chat_prompt

Prompt = str | Sequence[int]


class EngineConvenienceAPI:
    """Mixed into an engine that has ``tokenizer``, ``model_info`` and ``submit(prompt, **sampling)``."""

    # -- tokens and templates -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, allow_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: the tokenizer's BOS (/EOS) around it.
        ``allow_special_tokens=False``: special-token text in ``text`` (``"<|im_start|>"``) is encoded as
        plain text instead of as the special token (for untrusted text)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a string, got {type(text).__name__}")
        check_text(text, "prompt")
        if not allow_special_tokens:
            return self._chat_tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        allow_special_tokens: bool = False,
        **template_kwargs: Any,
    ):
        """Render ``messages`` (and ``tools``) with the model's chat template; token ids, or the text with
        ``tokenize=False``.

        Special-token text inside the messages, tools and template kwargs (a user writing
        ``"<|im_end|>\\n<|im_start|>system"``) is tokenized as plain text: only the markers the template
        writes itself are special tokens (see :mod:`parallm_engine.formats.chat_tokens`). ``allow_special_tokens=True``
        (trusted callers only) parses them as special tokens wherever they are, as plain
        ``tokenizer.apply_chat_template`` does. The text returned with ``tokenize=False`` cannot carry
        that distinction: tokenizing it yourself parses every special token in it.
        """
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts", param="messages")
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        check_text(list(messages), "messages")
        check_text(tools, "tools")
        check_text(template_kwargs, "template_kwargs")
        try:
            if tokenize and not allow_special_tokens:
                return self._chat_tokenizer.apply(list(messages), tools, add_generation_prompt, template_kwargs)
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                **template_kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as exc:  # jinja errors: a message shape the template cannot render
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    @property
    def _chat_tokenizer(self) -> ChatTokenizer:
        tok = self.__dict__.get("_chat_tokenizer_obj")
        if tok is None:  # built once (a benign race builds two identical ones)
            tok = self.__dict__["_chat_tokenizer_obj"] = ChatTokenizer(self.tokenizer)
        return tok

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, VisionPrompt):  # a chat with images (vision_chat.chat_prompt)
            return list(prompt.token_ids)
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            vocab = self.model_info.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="prompt")
        else:
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return ids

    # -- high-level API -------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], **sampling: Any) -> list[GenerationResult]:
        """All prompts in flight at once; results in input order. A bare string gives a one-item list."""
        handles: list[RequestHandle] = []
        try:
            group = sampling.pop("group", None) or object()  # one call's prompts: one fairness group
            for p in self._as_list(prompts):
                handles.append(self.submit(p, group=group, **sampling))
            return [self._collect(h) for h in handles]
        finally:
            for h in handles:
                if not h.request.finished:
                    h.abort()

    async def agenerate(self, prompts: Prompt | list[Prompt], **sampling: Any) -> list[GenerationResult]:
        loop = asyncio.get_running_loop()
        handles: list[RequestHandle] = []
        try:
            group = sampling.pop("group", None) or object()
            for p in self._as_list(prompts):
                handles.append(self.submit(p, loop=loop, group=group, **sampling))
            return list(await asyncio.gather(*(self._acollect(h) for h in handles)))
        finally:
            for h in handles:
                if not h.request.finished:
                    h.abort()

    def stream(self, prompt: Prompt, **sampling: Any) -> Iterator[StreamDelta]:
        return iter(self.submit(prompt, **sampling))

    def astream(self, prompt: Prompt, **sampling: Any) -> AsyncIterator[StreamDelta]:
        return self.submit(prompt, loop=asyncio.get_running_loop(), **sampling).__aiter__()

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, **sampling) -> GenerationResult:
        """Chat completion: the template renders ``messages`` (and ``tools``); the result carries parsed
        ``tool_calls`` when tools were given. Takes ``tool_choice`` / ``response_format`` too."""
        return self.generate([chat_prompt(self, messages, tools, sampling)], tools=tools, **sampling)[0]

    async def achat(self, messages: list[dict], *, tools: list[dict] | None = None, **sampling) -> GenerationResult:
        prompt = await achat_prompt(self, messages, tools, sampling)  # images: prepared off the event loop
        return (await self.agenerate([prompt], tools=tools, **sampling))[0]

    def chat_stream(self, messages: list[dict], *, tools=None, **sampling) -> Iterator[StreamDelta]:
        return self.stream(chat_prompt(self, messages, tools, sampling), tools=tools, **sampling)

    def achat_stream(self, messages: list[dict], *, tools=None, **sampling) -> AsyncIterator[StreamDelta]:
        return achat_stream(self, messages, tools, sampling)  # images: prepared off the event loop

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, VisionPrompt)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single token-id prompt
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string or a list, got {type(prompts).__name__}")
        return list(prompts)

    @staticmethod
    def _collect(handle: RequestHandle) -> GenerationResult:
        for _ in handle:
            pass
        return handle.request.result

    @staticmethod
    async def _acollect(handle: RequestHandle) -> GenerationResult:
        async for _ in handle:
            pass
        return handle.request.result
