"""``parallm serve``: an OpenAI-compatible HTTP server on the shared in-process engine.

Several processes (a notebook, a LangGraph server, scripts) can share one loaded model through it, and
any OpenAI client talks to it::

    parallm serve --port 8000 [--api-key KEY]          # or: serve(port=8000) from Python
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY").chat.completions.create(...)
    ChatParaLLM(base_url="http://127.0.0.1:8000/v1", api_key="KEY")

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream as server-sent
events), ``GET /v1/models[/{id}]``, ``POST /tokenize`` and ``/detokenize`` (vLLM-compatible; these in
:mod:`parallm_engine.serve.openai_routes`),
``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version``; the live view's ``GET /v1/status[/stream]``
and ``GET /dashboard`` (:mod:`parallm_engine.serve.live_routes`); Anthropic's ``POST /v1/messages[/count_tokens]``
(:mod:`parallm_engine.serve.anthropic_routes`) and OpenAI's ``/v1/responses`` (:mod:`parallm_engine.serve.responses_routes`),
translated onto the chat endpoint's request path (``docs/server-apis.md``).

Behaviour:
- Binds to 127.0.0.1 unless told otherwise. With API keys (one or several), every ``/v1/*`` and tokenizer
  request must carry one as ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``), else 401, and so must
  ``/docs``, ``/redoc`` and ``/openapi.json`` unless ``expose_docs``; ``/health`` and ``/metrics`` stay
  open for load balancers and scrapers (as in vLLM).
- Fair shares of the engine queue (:mod:`parallm_engine.serve.queue_shares`), counted in sequences (prompts x
  ``n``): one request may take at most ``max_request_share`` of ``max_queue`` (else 400,
  ``too_many_sequences``), and with several keys one key at most ``max_key_share`` (else 429 with
  ``Retry-After`` while the other keys are served).
- Every string in a request is checked before it reaches the tokenizer, the grammar compiler or an
  error message: lone UTF-16 surrogates (``"\\ud800"``) are refused with 400. Special-token text in chat
  messages is tokenized as plain text unless the request sets ``allow_special_tokens`` (the chat
  template's own markers are the only special tokens); a ``/v1/completions`` prompt is raw model input and
  has special tokens parsed unless it sets ``allow_special_tokens: false``.
- Every request is one engine request (``n`` choices sampled in the same batch); concurrent HTTP
  requests are decoded together. A client that disconnects (streaming or not) aborts its engine
  request, freeing its KV at the next engine step.
- Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: malformed JSON and
  invalid fields 400 (``invalid_request_error``; the field in ``param``), a prompt longer than the
  context 400 with ``code="context_length_exceeded"``, an unknown model 404, a full engine queue 429
  with ``Retry-After``, a stopped engine 503. Nothing a request sends can stop the server: an
  unexpected failure answers 500 and is logged.
- Errors after a stream has started arrive as one ``data: {"error": {...}}`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from parallm_engine import settings
from parallm_engine import __version__
from parallm_engine.serve.anthropic_format import anthropic_error, is_anthropic_path
from parallm_engine.serve.anthropic_routes import anthropic_router
from parallm_engine.serve.live_routes import add_live_routes
from parallm_engine.errors import ParaLLMError, RankLostError
from parallm_engine.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from parallm_engine.serve.trace_context import TraceContext
from parallm_engine.serve.metrics import ServerMetrics, render as render_metrics
from parallm_engine.serve.openai_format import APIError, api_error_from
from parallm_engine.serve.openai_routes import openai_router
from parallm_engine.serve.protocol import CloseSessionRequest, HealthResponse, now
from parallm_engine.serve.queue_shares import DEFAULT_KEY_SHARE, DEFAULT_REQUEST_SHARE, QueueShares
from parallm_engine.serve.responses_routes import responses_router
from parallm_engine.serve.server_embeddings import add_embedding_routes
from parallm_engine.serve.server_rerank import add_rerank_routes
from parallm_engine.serve.server_kit import ERROR_RESPONSES, ServerKit
from parallm_engine.core.validation import check_text, safe_text

logger = logging.getLogger("parallm_engine.serve.server")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: Model names every server answers to when it serves the embedded default model.
DEFAULT_MODEL_ALIASES = ("default", "SmolLM2-135M-Instruct")
# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        msg = "the request body must be a JSON object (Content-Type: application/json)"
    detail = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, detail, param=param)


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


class ServerState:
    """What the endpoints share: the engine, the names it answers to, the key, the metrics."""

    def __init__(self, engine, model, api_key: str | Sequence[str] | None, served_model_name: str | list[str] | None,
                 engine_config: dict[str, Any], max_request_share: float = DEFAULT_REQUEST_SHARE,
                 max_key_share: float = DEFAULT_KEY_SHARE):
        self.engine = engine
        self.model_arg = model
        self.engine_config = engine_config
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [k for k in dict.fromkeys(keys) if k]
        self.api_key = self.api_keys[0] if self.api_keys else None
        # Keys are told apart for fairness only when there are several (one key is one client).
        self.shares = QueueShares(lambda: self.engine.max_queue, max_request_share, max_key_share,
                                  by_key=len(self.api_keys) > 1)
        self.served_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.metrics = ServerMetrics()
        self.created = now()

    def load_engine(self):
        if self.engine is None:
            from parallm_engine.core.registry import get_engine

            self.engine = get_engine(self.model_arg, **self.engine_config)
        return self.engine

    @property
    def model_name(self) -> str:
        if self.served_names:
            return self.served_names[0]
        return self.engine.model_name if self.engine is not None else str(self.model_arg or "default")

    def accepted_names(self) -> set[str]:
        names = set(self.served_names)
        if self.engine is not None:
            names.add(self.engine.model_name)
        if self.model_arg is None:
            names.update(DEFAULT_MODEL_ALIASES)
        else:
            names.add(str(self.model_arg))
            names.add(os.path.basename(os.path.normpath(str(self.model_arg))))
        return names

    def adapter_names(self) -> list[str]:
        """The LoRA adapters served as models of their own (``--adapter NAME=PATH``)."""
        registry = getattr(self.engine, "adapters", None)
        return registry.names() if registry is not None else []

    def adapter_for(self, name: str | None) -> str | None:
        """The adapter a request's ``model`` names (vLLM's convention), or None for the base model."""
        return name if name and name not in self.accepted_names() and name in self.adapter_names() else None

    def check_model(self, name: str | None) -> str:
        if name in (None, "") or name in self.accepted_names():
            return self.model_name
        if self.adapter_for(name):
            return name
        shown = safe_text(name, 200)  # a name can be anything: escaped and cut short
        raise APIError(404, f"The model `{shown}` does not exist. This server serves `{self.model_name}`.",
                       param="model", code="model_not_found")

    def healthy(self) -> bool:
        eng = self.engine
        if eng is None or getattr(eng, "_dead", None) is not None:
            return False
        thread = getattr(eng, "_thread", None)
        return thread is None or thread.is_alive()

    def engine_or_503(self):
        if not self.healthy():
            dead = getattr(self.engine, "_dead", None)
            lost = isinstance(dead, RankLostError)  # a distributed engine's group broke: say which rank
            raise APIError(503, f"the engine is not running: {dead}" if lost else "the engine is not running",
                           type="server_error", code="rank_lost" if lost else "engine_dead")
        return self.engine


# ----------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------


class _HTTPCounter:
    """Pure ASGI middleware counting answered requests by endpoint, method and status (a streaming
    response is counted when it starts). Paths outside the API are one label, so fuzzing cannot blow
    up the metric's cardinality."""

    KNOWN = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
             "/v1/status", "/v1/status/stream", "/dashboard")

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.KNOWN else ("/v1/models/{id}" if path.startswith("/v1/models/") else
                                                    "/v1/responses/{id}" if path.startswith("/v1/responses/") else "other")
        method = scope.get("method", "")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_http(endpoint, method, message["status"])
            await send(message)

        return await self.app(scope, receive, counting_send)


class _BodyLimit:
    """Pure ASGI middleware refusing request bodies over ``limit`` bytes with 413, by Content-Length
    up front or while a chunked body streams in, so no request can exhaust the server's memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = StarletteHTTPException(413, f"request body is larger than {self.limit} bytes")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > self.limit:
                        return await _http_error_response(too_large, scope.get("path", ""))(scope, receive, send)
                except ValueError:
                    pass
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large
            return message

        return await self.app(scope, limited_receive, send)


def _http_error_response(exc: StarletteHTTPException, path: str) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
    return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code,
                                    headers=getattr(exc, "headers", None)), path)


def _error_response(err: APIError, path: str) -> JSONResponse:
    """The error in the shape the route's clients parse: Anthropic's on ``/v1/messages``, else OpenAI's."""
    return anthropic_error(err) if is_anthropic_path(path) else err.response()


def create_app(engine=None, model=None, api_key: str | Sequence[str] | None = None, *,
               served_model_name: str | list[str] | None = None, engine_config: dict[str, Any] | None = None,
               max_body_bytes: int = 32 << 20, expose_docs: bool = False,
               max_request_share: float = DEFAULT_REQUEST_SHARE, max_key_share: float = DEFAULT_KEY_SHARE,
               embedding_model=None, rerank_model=None) -> FastAPI:
    """The FastAPI app serving ``engine`` (or, when None, the shared engine for ``model`` and
    ``engine_config``, loaded at startup). ``api_key``: a key, or several, one of which ``/v1/*``, the
    tokenizer endpoints and (unless ``expose_docs``) ``/docs``, ``/redoc`` and ``/openapi.json`` require.
    ``served_model_name``: the name(s) clients use (default: the engine's model name).
    ``max_body_bytes``: larger request bodies are refused with 413. ``max_request_share`` /
    ``max_key_share``: the most of the engine's ``max_queue``, in sequences (prompts x n), that one
    request / one key (with several keys) may hold (see :mod:`parallm_engine.serve.queue_shares`).
    ``embedding_model``: ``/v1/embeddings`` embeds with this model instead of the served one
    (:mod:`parallm_engine.serve.server_embeddings`). ``rerank_model``: ``/v1/rerank``, ``/rerank`` and
    ``/v2/rerank`` rerank with this model instead of the served one (:mod:`parallm_engine.serve.server_rerank`)."""
    state = ServerState(engine, model, api_key, served_model_name, dict(engine_config or {}),
                        max_request_share=max_request_share, max_key_share=max_key_share)
    docs_behind_key = bool(state.api_keys) and not expose_docs

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None:
            await asyncio.to_thread(state.load_engine)
        yield

    hidden = {"openapi_url": None, "docs_url": None, "redoc_url": None} if docs_behind_key else {}
    app = FastAPI(title="ParaLLM", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API on ParaLLM's continuous-batching engine.", **hidden)
    app.state.parallm = state
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.add_middleware(_HTTPCounter, metrics=state.metrics)
    app.add_middleware(TraceContext)  # a caller's traceparent: the engine's spans are its children

    # -- error handlers ---------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _http_error_response(exc, request.url.path)

    @app.exception_handler(ParaLLMError)
    async def _engine_error(request: Request, exc: ParaLLMError):
        return _error_response(api_error_from(exc), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return _error_response(api_error_from(exc), request.url.path)

    # -- auth ---------------------------------------------------------------------------------------
    async def require_key(request: Request) -> None:
        if not state.api_keys:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        # Headers arrive as latin-1 text: compare bytes, every key (no early exit on a match).
        raw = token.encode("latin-1", "replace")
        matches = [hmac.compare_digest(raw, key.encode()) for key in state.api_keys]
        if not token or not any(matches):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        request.state.parallm_key = matches.index(True)  # which client, for its share of the queue

    async def require_valid_text(request: Request) -> None:
        """400 for a body with a string that is not valid Unicode (a lone UTF-16 surrogate, which JSON can
        carry), anywhere in it: before anything tokenizes it, compiles it or quotes it in an error."""
        try:
            body = await request.json()  # parsed once: FastAPI has already read it (and cached it)
        except Exception:  # not JSON: FastAPI's validation answers it
            return
        check_text(body, "")

    auth = [Depends(require_key)]
    checked = [Depends(require_key), Depends(require_valid_text)]  # in this order: 401 before 400

    if docs_behind_key:  # the schema and its viewers need a key too (a browser can't send one: --expose-docs)
        from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

        @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
        async def openapi_schema():
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False, dependencies=auth)
        async def swagger_docs():
            return get_swagger_ui_html(openapi_url="/openapi.json", title="ParaLLM - Swagger UI")

        @app.get("/redoc", include_in_schema=False, dependencies=auth)
        async def redoc_docs():
            return get_redoc_html(openapi_url="/openapi.json", title="ParaLLM - ReDoc")

    # -- info endpoints ------------------------------------------------------------------------------
    @app.get("/health", response_model=HealthResponse, responses={503: ERROR_RESPONSES[503]})
    async def health():
        if not state.healthy():
            return JSONResponse({"status": "unavailable", "model": state.model_name}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        stats = state.engine.stats() if state.engine is not None else None
        body = render_metrics(stats, state.metrics, state.model_name, healthy=state.healthy())
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    @app.post("/reset_prefix_cache", dependencies=auth, responses={401: ERROR_RESPONSES[401]})
    async def reset_prefix_cache():
        """Drop every cached prefix no request in flight uses (vLLM's route); the bytes freed."""
        engine = state.engine_or_503()
        freed = await asyncio.to_thread(engine.clear_prefix_cache)
        return {"freed_bytes": freed}

    @app.post("/close_session", dependencies=checked, responses={400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401]})
    async def close_session(body: CloseSessionRequest):
        """SGLang's route: the agent run ``session_id`` names is over; its pinned context is let go at once."""
        engine = state.engine_or_503()
        return await asyncio.to_thread(engine.close_session, body.session_id)

    # -- the APIs: OpenAI's, embeddings, Anthropic's Messages, OpenAI's Responses, on one request path -----
    kit = ServerKit(state, checked, auth)
    app.include_router(openai_router(kit))
    add_embedding_routes(app, state, checked, embedding_model, engine_config)
    add_rerank_routes(app, state, checked, rerank_model, engine_config)
    app.include_router(anthropic_router(kit))
    app.include_router(responses_router(kit))
    add_live_routes(app, state.engine_or_503, state.api_keys)  # /v1/status, /dashboard (live_routes.py)
    return app


# ----------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------


def api_keys_from_env() -> list[str]:
    """Keys from ``$PARALLM_API_KEYS`` (comma-separated) and ``$PARALLM_API_KEY``."""
    return settings.api_keys()


def serve(model=None, host: str = "127.0.0.1", port: int = 8000, api_key: str | Sequence[str] | None = None, *,
          served_model_name: str | list[str] | None = None, log_level: str = "info", expose_docs: bool = False,
          max_request_share: float = DEFAULT_REQUEST_SHARE, max_key_share: float = DEFAULT_KEY_SHARE,
          embedding_model=None, rerank_model=None, **engine_config) -> None:
    """Load the model (the process-wide shared engine) and serve it until interrupted.

    ``api_key`` (one key or several) defaults to ``$PARALLM_API_KEYS`` (comma-separated) and
    ``$PARALLM_API_KEY``; ``expose_docs``, ``max_request_share`` and ``max_key_share`` are
    :func:`create_app`'s; ``engine_config`` goes to :func:`get_engine` (``max_batch_size``, ``max_queue``,
    ``enable_prefix_cache``, ...).
    """
    import uvicorn

    from parallm_engine.core.registry import get_engine

    keys = ([api_key] if isinstance(api_key, str) else list(api_key or [])) or api_keys_from_env()
    engine = get_engine(model, **engine_config)
    app = create_app(engine=engine, model=model, api_key=keys, served_model_name=served_model_name,
                     expose_docs=expose_docs, max_request_share=max_request_share, max_key_share=max_key_share,
                     embedding_model=embedding_model, rerank_model=rerank_model)
    if host not in LOOPBACK_HOSTS and not keys:
        logger.warning("serving on %s without an API key: anyone who can reach this port can use the model "
                       "(pass --api-key to require one)", host)
    shown = f"[{host}]" if ":" in host else host
    print(f"ParaLLM serving {app.state.parallm.model_name} at http://{shown}:{port}/v1"
          f"{' (API key required)' if keys else ''}", flush=True)
    shares = app.state.parallm.shares
    print(f"Queue shares: one request at most {shares.request_limit()} sequences (prompts x n)"
          + (f", one key at most {shares.key_limit()}" if shares.key_limit() else ""), flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    if getattr(engine, "dist", None) is not None:
        _distributed_server(config, engine).run()
    else:
        uvicorn.Server(config).run()


def _distributed_server(config, engine):
    import uvicorn

    class DistributedServer(uvicorn.Server):
        """Rank 0 of a distributed engine. ``mlx.launch`` stops every rank (SIGTERM) once one of them exits:
        the requests in flight then end with ``RankLostError`` at once (an error event on a stream, 503 on the
        rest), and the server keeps answering 503 for ``LINGER_S`` so clients and load balancers see why,
        before it stops."""

        LINGER_S = 5.0

        def __init__(self, config, engine):
            super().__init__(config)
            self.engine = engine
            self._lost_at: float | None = None

        def handle_exit(self, sig, frame) -> None:
            from parallm_engine.core.distributed_core import lost_rank_error

            if self._lost_at is not None:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            self._lost_at = time.monotonic()
            logger.warning("signal %s: the distributed group is stopping; answering 503 for %.0f s", sig,
                           self.LINGER_S)
            if self.engine.core.dead is None:
                self.engine.core.group_lost(lost_rank_error(self.engine.dist))
            threading.Timer(self.LINGER_S, super().handle_exit, (sig, frame)).start()

    return DistributedServer(config, engine)


class ServerThread:
    """The server in a background thread of this process: a notebook can share its loaded model with
    other processes, and tests can talk to a real socket. ``port=0`` picks a free port::

        with ServerThread(engine=get_engine()) as srv:
            OpenAI(base_url=srv.base_url, api_key="EMPTY") ...
    """

    def __init__(self, app: FastAPI | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", **create_app_kwargs):
        import uvicorn

        self.app = app if app is not None else create_app(**create_app_kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self.host, self.port = host, port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What OpenAI clients and ``ChatParaLLM(base_url=...)`` take."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 120.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, name="parallm-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["create_app", "serve", "ServerThread", "APIError", "api_error_from"]
