"""``ParaLLM``: a LangChain text-completion LLM on ParaLLM's shared in-process engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from ._common import EngineRequest, ParaLLMParams
from ._lc_results import PROVIDER, final_text_chunk, llm_result, text_chunk


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
    def _backend_options(self) -> dict[str, Any]:
        return {"raw_text_special_tokens": self.allow_special_tokens}

    def _request(self, stop: list[str] | None, kwargs: dict[str, Any]) -> EngineRequest:
        req = self._build_request(stop, kwargs)
        if req.tools:
            raise ValueError("ParaLLM is a text-completion LLM; use ChatParaLLM.bind_tools for tool calling")
        return req

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
        backend = self._backend()
        if self.streaming and len(prompts) == 1 and not backend.is_remote:
            return self._generate_streaming(prompts[0], stop, run_manager, **kwargs)
        results = backend.run_many(list(prompts), req)
        return llm_result(results, backend.result_model(req, results[0] if results else None))

    def _generate_streaming(self, prompt, stop, run_manager, **kwargs) -> LLMResult:
        final: GenerationChunk | None = None
        for chunk in self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs):
            final = chunk if final is None else final + chunk
        assert final is not None
        info = dict(final.generation_info or {})
        usage = info.pop("token_usage", None)
        return LLMResult(
            generations=[[Generation(text=final.text, generation_info=info)]],
            llm_output={"token_usage": usage, "model_name": info.get("model_name"), "model_provider": PROVIDER},
        )

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        req = self._request(stop, kwargs)
        backend = self._backend()
        results = await backend.arun_many(list(prompts), req)
        return llm_result(results, backend.result_model(req, results[0] if results else None))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        # BaseLLM.stream does not fire token callbacks itself: this method does.
        req = self._request(stop, kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.stream(prompt, req)
        finish_reason, usage = None, None
        try:
            for delta in deltas:
                finish_reason = delta.finish_reason or finish_reason
                usage = delta.usage or usage
                chunk = text_chunk(delta)
                if chunk is None:
                    continue
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk, verbose=self.verbose)
                yield chunk
        finally:
            deltas.close()
        yield final_text_chunk(backend.result_model(req), finish_reason, usage)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        req = self._request(stop, kwargs)
        req.check_streamable()
        backend = self._backend()
        deltas = backend.astream(prompt, req)
        finish_reason, usage = None, None
        try:
            async for delta in deltas:
                finish_reason = delta.finish_reason or finish_reason
                usage = delta.usage or usage
                chunk = text_chunk(delta)
                if chunk is None:
                    continue
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk, verbose=self.verbose)
                yield chunk
        finally:
            await deltas.aclose()
        yield final_text_chunk(backend.result_model(req), finish_reason, usage)


__all__ = ["ParaLLM"]
