"""OpenAI's own routes of ``parallm serve``: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (both
stream as server-sent events), ``GET /v1/models[/{id}]`` (in Anthropic's shape for the anthropic SDK), and
vLLM's ``POST /tokenize`` / ``/detokenize``. Built on the request path every API shares
(:class:`~parallm_engine.serve.server_kit.ServerKit`); app, middleware and errors are :mod:`parallm_engine.serve.server`'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from parallm_engine.serve.anthropic_format import anthropic_model_card, anthropic_model_list
from parallm_engine.serve.openai_format import (
    APIError,
    Timing,
    abort_all,
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
)
from parallm_engine.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from parallm_engine.serve.request_identity import identity_fields, identity_kwargs
from parallm_engine.serve.server_kit import ERROR_RESPONSES, EngineStream, ServerKit, message_dict


def openai_router(kit: ServerKit) -> APIRouter:
    router = APIRouter()
    state = kit.state

    def _card() -> ModelCard:
        return ModelCard.with_context(getattr(state.engine, "context_window", None), id=state.model_name,
                                      created=state.created)

    @router.get("/v1/models", response_model=ModelList, dependencies=kit.auth,
                responses={401: ERROR_RESPONSES[401]})
    async def list_models(request: Request):
        adapters = [ModelCard.with_context(getattr(state.engine, "context_window", None), id=name,
                                           created=state.created, parent=state.model_name)
                    for name in state.adapter_names()]
        if "anthropic-version" in request.headers:  # the anthropic SDK's models.list shape
            return JSONResponse(anthropic_model_list([_card(), *adapters]))
        return ModelList(data=[_card(), *adapters])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=kit.auth,
                responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
    async def get_model(model_id: str, request: Request):
        state.check_model(model_id)
        card = _card()
        if state.adapter_for(model_id):
            card = ModelCard.with_context(card.max_model_len, id=model_id, created=state.created, parent=card.id)
        if "anthropic-version" in request.headers:
            return JSONResponse(anthropic_model_card(card))
        return card

    # -- tokenizer ------------------------------------------------------------------------------------
    @router.post("/tokenize", response_model=TokenizeResponse, dependencies=kit.checked,
                 responses={k: ERROR_RESPONSES[k] for k in (400, 401, 404)})
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        eng = state.engine_or_503()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            msgs = [message_dict(m) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = list(eng.apply_chat_template(msgs, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                               allow_special_tokens=bool(req.allow_special_tokens)))
        else:
            allow = True if req.allow_special_tokens is None else req.allow_special_tokens
            ids = eng.encode(req.prompt, add_special_tokens=req.add_special_tokens, allow_special_tokens=allow)
        return TokenizeResponse(count=len(ids), max_model_len=eng.context_window, tokens=ids)

    @router.post("/detokenize", response_model=DetokenizeResponse, dependencies=kit.checked,
                 responses={k: ERROR_RESPONSES[k] for k in (400, 401, 404)})
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        eng = state.engine_or_503()
        vocab = eng.model_info.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=eng.decode(req.tokens))

    # -- generation -----------------------------------------------------------------------------------
    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=kit.checked,
                 responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        p = kit.prepare_chat(req, req.template_kwargs())
        if req.stream:
            return await kit.stream_chat(p, request, "chat", lambda run: chat_stream(
                run.handles, run.timing, p.model_name, p.single_call, req.include_usage))
        result = await kit.complete_chat(p, request, "chat")
        return JSONResponse(chat_response(result, p.model_name, p.single_call))

    @router.post("/v1/completions", response_model=CompletionResponse, dependencies=kit.checked,
                 responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def completions(req: CompletionRequest, request: Request):
        model_name = state.check_model(req.model)
        eng = state.engine_or_503()
        prompts = _completion_prompts(req.prompt)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of must equal n (every sampled choice is returned)", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        kwargs = kit.submit_kwargs(req)
        kwargs.update(identity_kwargs(request.headers, identity_fields(req)))
        n = req.n or 1
        timing = Timing(state.metrics)
        lease = kit.reserve(request, len(prompts) * n, "completions", "prompt")
        try:
            # Plain-text tokenizing of text prompts when asked (the engine itself parses special tokens).
            engine_prompts = prompts if req.allow_special_tokens else [
                eng.encode(p, allow_special_tokens=False) if isinstance(p, str) else p for p in prompts]
            handles = await kit.submit(engine_prompts, kwargs, "completions", offload="response_format" in kwargs)
            try:  # after submit, which has checked token ids are in the vocabulary
                echoes = [(p if isinstance(p, str) else eng.decode(p)) if req.echo else "" for p in prompts]
            except BaseException:
                abort_all(handles)
                raise
            if req.stream:
                gen = completion_stream(handles, timing, model_name, n, echoes, req.logprobs is not None,
                                         req.include_usage)
                stream, lease = EngineStream(gen, handles, kit.stream_closed("completions", timing, handles), lease), None
                return stream  # the stream gives the lease back when it ends
            results = await kit.run_to_completion(request, handles, timing, "completions")
        finally:
            if lease is not None:
                lease.release()
        return JSONResponse(completion_response(results, model_name, n, echoes, req.logprobs is not None))

    return router


def _completion_prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise APIError(400, "token-id prompts must not be empty", param="prompt")
        return [list(p) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
