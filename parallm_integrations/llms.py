"""``ParaLLM``: a LangChain text-completion LLM on ParaLLM's shared in-process engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from ._common import EngineCall, EngineRequest, ParaLLMParams, remote_function
from ._messages import logprobs_to_openai, normalize_response_format, token_usage_dict

_PROVIDER = "parallm"


def _sum_usage(results) -> dict[str, Any]:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    for r in results:
        u = token_usage_dict(r.usage)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[k] += u[k]
        total["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
    return total


class ParaLLM(ParaLLMParams, BaseLLM):
    """Text-completion LLM on ParaLLM's shared in-process engine (no chat template: the prompt is
    sent as it is).

    It subclasses ``BaseLLM`` (not ``LLM``), so ``batch`` / ``abatch`` / ``generate`` hand the whole
    prompt list to one ``_generate`` call, which submits every prompt before waiting for any: they are
    decoded as one batch. Constructing loads nothing; the model loads on first use.

    Instantiate:
        .. code-block:: python

            from parallm_integrations import ParaLLM

            llm = ParaLLM(temperature=0, max_tokens=32)
            llm.invoke("The capital of France is")
            llm.batch([f"{i} + {i} =" for i in range(32)])    # 32 requests in flight at once

    Stream:
        .. code-block:: python

            for token in llm.stream("Once upon a time"):
                print(token, end="")

    ``llm_output["token_usage"]`` sums usage over the prompts (``prompt_tokens_details.cached_tokens``
    counts prompt tokens served from the prefix cache).
    """

    @property
    def _llm_type(self) -> str:
        return "parallm"

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["parallm_integrations", "llms"]

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("llm", stop, kwargs)

    allow_special_tokens: bool = True
    """Whether special-token text in the prompt (``"<|im_start|>"``) is parsed as special tokens. The
    prompt is the model's raw input, so True by default (as vLLM's completions do: a prompt may carry its
    own chat markup); False tokenizes it as plain text, for prompts that embed untrusted text. With
    ``base_url`` it is sent to the server (``parallm serve`` reads it)."""

    # -- requests --------------------------------------------------------------------------------
    def _engine_prompt(self, engine, prompt: str) -> str | list[int]:
        return prompt if self.allow_special_tokens else engine.encode(prompt, allow_special_tokens=False)

    def _remote_params(self, req: EngineRequest) -> dict[str, Any]:
        params = super()._remote_params(req)
        if not self.allow_special_tokens:  # a ParaLLM extension: sent only when it differs from the default
            params["allow_special_tokens"] = False
        return params

    def _request(self, stop: list[str] | None, kwargs: dict[str, Any]) -> EngineRequest:
        req = self._build_request(stop, kwargs)
        if req.tools:
            raise ValueError("ParaLLM is a text-completion LLM; use ChatParaLLM.bind_tools for tool calling")
        req.response_format = normalize_response_format(req.response_format)
        return req

    def _generations(self, result) -> list[Generation]:
        out = []
        for choice in result.choices:
            info: dict[str, Any] = {"finish_reason": choice.finish_reason}
            logprobs = logprobs_to_openai(choice.logprobs)
            if logprobs:
                info["logprobs"] = logprobs
            out.append(Generation(text=choice.text, generation_info=info))
        return out

    def _llm_result(self, results, model_name: str) -> LLMResult:
        return LLMResult(
            generations=[self._generations(r) for r in results],
            llm_output={"token_usage": _sum_usage(results), "model_name": model_name, "model_provider": _PROVIDER},
        )

    def _final_chunk(self, call: EngineCall, model_name: str, finish_reason: str | None) -> GenerationChunk:
        result = call.result
        info: dict[str, Any] = {"finish_reason": finish_reason or getattr(result, "finish_reason", None),
                                "model_name": model_name, "model_provider": _PROVIDER}
        if result is not None:
            info["token_usage"] = token_usage_dict(result.usage)
        return GenerationChunk(text="", generation_info=info)

    # -- LangChain hooks -------------------------------------------------------------------------
    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Submit every prompt, then wait: all of them are decoded together."""
        req = self._request(stop, kwargs)
        if self.base_url:
            return remote_function("completion_generate")(self, prompts, self._remote_params(req), run_manager=run_manager)
        if self.streaming and len(prompts) == 1:
            return self._generate_streaming(prompts[0], stop, run_manager, **kwargs)
        engine = self._get_engine(req.model)
        calls: list[EngineCall] = []
        try:
            for prompt in prompts:
                calls.append(EngineCall(engine, self._engine_prompt(engine, prompt), req))
            for call in calls:
                for _ in call:
                    pass
        finally:
            for call in calls:
                call._finish()
        return self._llm_result([c.result for c in calls], engine.model_name)

    def _generate_streaming(self, prompt, stop, run_manager, **kwargs) -> LLMResult:
        final: GenerationChunk | None = None
        for chunk in self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs):
            final = chunk if final is None else final + chunk
        assert final is not None
        info = dict(final.generation_info or {})
        usage = info.pop("token_usage", None)
        return LLMResult(
            generations=[[Generation(text=final.text, generation_info=info)]],
            llm_output={"token_usage": usage, "model_name": info.get("model_name"), "model_provider": _PROVIDER},
        )

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        req = self._request(stop, kwargs)
        if self.base_url:
            return await remote_function("acompletion_generate")(
                self, prompts, self._remote_params(req), run_manager=run_manager
            )
        engine = await self._aget_engine(req.model)
        loop = asyncio.get_running_loop()
        calls: list[EngineCall] = []

        async def drain(call: EngineCall) -> None:
            async for _ in call:
                pass

        try:
            for prompt in prompts:
                calls.append(EngineCall(engine, self._engine_prompt(engine, prompt), req, loop=loop))
            await asyncio.gather(*(drain(c) for c in calls))
        finally:
            for call in calls:
                call._finish()
        return self._llm_result([c.result for c in calls], engine.model_name)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        # BaseLLM.stream does not fire token callbacks itself: this method does.
        req = self._request(stop, kwargs)
        if (req.sampling.get("n") or 1) > 1:
            raise ValueError("n must be 1 when streaming")
        if self.base_url:
            for chunk in remote_function("completion_stream")(self, prompt, self._remote_params(req), run_manager=run_manager):
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            return
        engine = self._get_engine(req.model)
        call = EngineCall(engine, self._engine_prompt(engine, prompt), req)
        iterator = iter(call)
        finish_reason = None
        try:
            for delta in iterator:
                finish_reason = delta.finish_reason or finish_reason
                logprobs = logprobs_to_openai(delta.logprobs)
                if not delta.text and not logprobs:
                    continue
                chunk = GenerationChunk(text=delta.text, generation_info={"logprobs": logprobs} if logprobs else None)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk, verbose=self.verbose)
                yield chunk
        finally:
            iterator.close()
        yield self._final_chunk(call, engine.model_name, finish_reason)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        req = self._request(stop, kwargs)
        if (req.sampling.get("n") or 1) > 1:
            raise ValueError("n must be 1 when streaming")
        if self.base_url:
            async for chunk in remote_function("acompletion_stream")(
                self, prompt, self._remote_params(req), run_manager=run_manager
            ):
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            return
        engine = await self._aget_engine(req.model)
        call = EngineCall(engine, self._engine_prompt(engine, prompt), req, loop=asyncio.get_running_loop())
        iterator = call.__aiter__()
        finish_reason = None
        try:
            async for delta in iterator:
                finish_reason = delta.finish_reason or finish_reason
                logprobs = logprobs_to_openai(delta.logprobs)
                if not delta.text and not logprobs:
                    continue
                chunk = GenerationChunk(text=delta.text, generation_info={"logprobs": logprobs} if logprobs else None)
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk, verbose=self.verbose)
                yield chunk
        finally:
            await iterator.aclose()
        yield self._final_chunk(call, engine.model_name, finish_reason)


__all__ = ["ParaLLM"]
