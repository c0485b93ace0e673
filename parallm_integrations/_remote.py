"""The ``base_url=`` path: run ParaLLM's classes against any OpenAI-compatible server (``parallm
serve``, vLLM, SGLang, mlx-lm's server, ...) through the official ``openai`` client.

Two layers. Results have the engine's shapes, so a class's code does not care where a result came from.

1. Engine-shaped, framework-free (for LlamaIndex and anything else; defined in ``_remote_client``,
   re-exported here)::

       client = get_client(base_url, api_key=None, max_retries=2)       # cached per (url, key, retries)
       client.chat(messages, *, model=None, tools=None, tool_choice=None, response_format=None,
                   parallel_tool_calls=None, timeout=None, **sampling) -> RemoteResult
       await client.achat(...)                                           -> RemoteResult
       client.chat_stream(messages, ...)                                 -> Iterator[RemoteDelta]
       client.achat_stream(messages, ...)                                -> AsyncIterator[RemoteDelta]
       client.generate(prompts, *, model=None, response_format=None, timeout=None, **sampling)
                                                                         -> list[RemoteResult]
       await client.agenerate(prompts, ...)                              -> list[RemoteResult]
       client.stream(prompt, ...) / client.astream(prompt, ...)          -> (Async)Iterator[RemoteDelta]
       client.models() / await client.amodels()                          -> list[str]
       client.context_window(model=None)                                 -> int | None (max_model_len)
       client.resolve_model(name) / await client.aresolve_model(name)    -> str
       client.tokenize(text, model=None, add_special_tokens=False)       -> list[int]  (vLLM /tokenize)
       client.tokenize_messages(messages, model=None, tools=None, add_generation_prompt=False) -> list[int]

   ``messages`` are OpenAI message dicts, ``tools`` OpenAI tool dicts, ``sampling`` the engine's
   keyword names (max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
   frequency_penalty, logit_bias, seed, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, n,
   include_stop_str_in_output). OpenAI's own fields go as themselves; the others go in ``extra_body``
   (vLLM and SGLang read them there). ``prompts`` of ``generate`` go in ONE HTTP request, so the server
   batches them.

   * ``RemoteResult`` has :class:`parallm_engine.GenerationResult`'s fields (plus ``model``, the name the
     server answered with); nothing here imports ``parallm_engine`` or MLX. Each ``RemoteChoice`` has
     ``text`` = ``content`` = the message text without tool-call markup, ``tool_calls`` =
     :class:`RemoteToolCall` (``chat_format.ToolCall``'s fields: ``arguments`` is the parsed dict; plus
     ``raw_arguments`` and ``error``, set when the server sent arguments that are not a JSON object),
     ``finish_reason`` as the server sent it ("tool_calls" when it made calls), ``logprobs`` = OpenAI's
     chat logprobs dict ``{"content": [...]}`` as the server formatted it (a completions response's are
     reshaped into it), ``token_ids`` = []. ``usage`` is a ``Usage`` (``cached_tokens`` from
     ``prompt_tokens_details.cached_tokens``, 0 when the server does not say).
   * ``RemoteDelta`` has :class:`parallm_engine.StreamDelta`'s fields plus ``tool_calls``: a list of
     ``RemoteToolCallDelta`` (``chat_format.ToolCallDelta``'s fields: index, id and name on a call's first
     delta, argument JSON text in pieces after). As from the engine, ``finish_reason`` is set on a
     choice's last delta and ``usage`` on the request's very last delta (streams ask for
     ``stream_options.include_usage``; a server that sends no usage leaves it None). Leaving the
     iteration early closes the HTTP stream, which aborts the request on ``parallm serve`` (and on
     vLLM / SGLang).
   * Errors are the engine's (:mod:`parallm_integrations.errors`: the engine's own classes when it is
     installed, the same hierarchy when not): a 400 is ``InvalidRequestError`` (``ContextLengthExceededError`` when the
     server says ``context_length_exceeded``), a 429 ``QueueFullError`` (``retry_after`` from the
     header), an unknown model ``ModelLoadError``, a client-side timeout ``TimeoutError``; the
     ``openai`` exception is chained as ``__cause__``. Others (401, 5xx, connection) are the ``openai``
     exceptions, after the client's own retries (``max_retries``, for 429 / 5xx / connection errors).
   * ``model=None`` or a spelling of the default model ("default", "SmolLM2-135M-Instruct") is sent as
     the server's own model when the server does not know that name (looked up once on ``/v1/models``),
     so ``ChatParaLLM(base_url=...)`` with no model works against a vLLM server too.
   * The API key is always passed explicitly ("EMPTY" when there is none): ``OPENAI_API_KEY`` from the
     environment is never sent to a ``base_url``.

2. LangChain adapters over an OpenAI-style request body ``params`` (sampling settings, ``model``, ``tools`` /
   ``tool_choice`` / ``parallel_tool_calls`` / ``response_format``, ``timeout``), for code that holds such a
   body; ``llm`` supplies ``base_url``, ``api_key`` and ``max_retries``. The classes themselves run through
   :class:`parallm_integrations.backends.RemoteBackend` and map results with the same functions
   (``_lc_results``, ``_lc_chunks``)::

       chat_generate(llm, messages, params, run_manager=None) -> ChatResult
       async achat_generate(llm, messages, params, run_manager=None) -> ChatResult
       chat_stream(llm, messages, params, run_manager=None) -> Iterator[ChatGenerationChunk]
       achat_stream(llm, messages, params, run_manager=None) -> AsyncIterator[ChatGenerationChunk]
       completion_generate(llm, prompts, params, run_manager=None) -> LLMResult
       async acompletion_generate(llm, prompts, params, run_manager=None) -> LLMResult
       completion_stream(llm, prompt, params, run_manager=None) -> Iterator[GenerationChunk]
       acompletion_stream(llm, prompt, params, run_manager=None) -> AsyncIterator[GenerationChunk]
       get_token_ids(llm, text) -> list[int]
       get_num_tokens_from_messages(llm, messages, tools=None) -> int      (OpenAI dicts in)

   (the last two raise ``NotImplementedError`` for a server without ``/tokenize``; the classes then
   fall back to LangChain's estimate).

   They build exactly what the in-process paths build (same ``response_metadata``, ``usage_metadata``
   with ``input_token_details.cache_read``, ``tool_call_chunks``, last chunk with
   ``chunk_position="last"``) and fire no callbacks.
"""

from __future__ import annotations

from typing import Any

from ._lc_chunks import _ChatChunks
from ._lc_results import chat_result, final_text_chunk, llm_result, text_chunk
from ._remote_client import (  # noqa: F401  (re-exported: the engine-shaped layer)
    DEFAULT_MODEL_ALIASES,
    RemoteChoice,
    RemoteClient,
    RemoteDelta,
    RemoteResult,
    RemoteToolCall,
    RemoteToolCallDelta,
    Usage,
    _StreamState,
    get_client,
)
from .backends import check_forced_call


def client_for(llm) -> RemoteClient:
    """The client for a ``ChatParaLLM`` / ``ParaLLM`` (or anything with ``base_url``, ``api_key``
    (str or SecretStr) and ``max_retries``)."""
    key = getattr(llm, "api_key", None)
    if key is not None and hasattr(key, "get_secret_value"):
        key = key.get_secret_value()
    return get_client(llm.base_url, key or None, max_retries=getattr(llm, "max_retries", 2))


def _split_params(params: dict[str, Any]) -> dict[str, Any]:
    """A request body -> RemoteClient keyword arguments."""
    kw = dict(params)
    kw.pop("stream", None)
    kw.pop("stream_options", None)
    return kw


def _to_chat_result(llm, result: RemoteResult, params: dict[str, Any]):
    for choice in result.choices:
        check_forced_call(llm.base_url, params, bool(choice.tool_calls), choice.finish_reason)
    return chat_result(result, result.model or str(params.get("model")), params.get("parallel_tool_calls") is False)


def chat_generate(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    return _to_chat_result(llm, client_for(llm).chat(messages, **_split_params(params)), params)


async def achat_generate(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    return _to_chat_result(llm, await client_for(llm).achat(messages, **_split_params(params)), params)


def chat_stream(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    builder = _ChatChunks(params)
    stream = client_for(llm).chat_stream(messages, **_split_params(params))
    try:
        for delta in stream:
            yield from builder.feed(delta)
    finally:
        stream.close()
    check_forced_call(llm.base_url, params, builder.saw_call, builder.finish_reason)
    yield from builder.finish()


async def achat_stream(llm, messages: list[dict], params: dict[str, Any], run_manager=None):
    builder = _ChatChunks(params)
    stream = client_for(llm).achat_stream(messages, **_split_params(params))
    try:
        async for delta in stream:
            for chunk in builder.feed(delta):
                yield chunk
    finally:
        await stream.aclose()
    check_forced_call(llm.base_url, params, builder.saw_call, builder.finish_reason)
    for chunk in builder.finish():
        yield chunk


def _llm_result(results: list[RemoteResult], params: dict[str, Any]):
    return llm_result(results, (results[0].model if results else None) or str(params.get("model")))


def completion_generate(llm, prompts: list[str], params: dict[str, Any], run_manager=None):
    return _llm_result(client_for(llm).generate(list(prompts), **_split_params(params)), params)


async def acompletion_generate(llm, prompts: list[str], params: dict[str, Any], run_manager=None):
    return _llm_result(await client_for(llm).agenerate(list(prompts), **_split_params(params)), params)


def completion_stream(llm, prompt: str, params: dict[str, Any], run_manager=None):
    finish_reason, usage = None, None
    stream = client_for(llm).stream(prompt, **_split_params(params))
    try:
        for delta in stream:
            finish_reason = delta.finish_reason or finish_reason
            usage = delta.usage or usage
            chunk = text_chunk(delta)
            if chunk is not None:
                yield chunk
    finally:
        stream.close()
    yield final_text_chunk(str(params.get("model")), finish_reason, usage)


async def acompletion_stream(llm, prompt: str, params: dict[str, Any], run_manager=None):
    finish_reason, usage = None, None
    stream = client_for(llm).astream(prompt, **_split_params(params))
    try:
        async for delta in stream:
            finish_reason = delta.finish_reason or finish_reason
            usage = delta.usage or usage
            chunk = text_chunk(delta)
            if chunk is not None:
                yield chunk
    finally:
        await stream.aclose()
    yield final_text_chunk(str(params.get("model")), finish_reason, usage)


def get_token_ids(llm, text: str) -> list[int]:
    return client_for(llm).tokenize(text, model=getattr(llm, "model", None), add_special_tokens=False)


def get_num_tokens_from_messages(llm, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Tokens of OpenAI message dicts (and OpenAI tool dicts) rendered with the server's template."""
    return len(client_for(llm).tokenize_messages(messages, model=getattr(llm, "model", None), tools=tools))


__all__ = [
    "RemoteClient", "RemoteDelta", "RemoteResult", "RemoteToolCall", "get_client", "client_for",
    "chat_generate", "achat_generate", "chat_stream", "achat_stream", "completion_generate",
    "acompletion_generate", "completion_stream", "acompletion_stream", "get_token_ids",
    "get_num_tokens_from_messages",
]
