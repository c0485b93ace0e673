"""The live page of an in-process engine (issue 76): ``serve_dashboard(engine)`` serves ``/dashboard`` and
``/v1/status`` (:mod:`parallm_engine.serve.live_routes`) from a thread of this process, on loopback by default,
and returns the page's URL; no model API is served with it (``parallm serve`` has both)."""

from __future__ import annotations

import threading
from typing import Sequence

from fastapi import FastAPI, Request

from parallm_engine.serve.live_routes import add_live_routes
from parallm_engine.serve.openai_format import APIError
from parallm_engine.serve.server import ServerThread


def live_app(engine, api_key: str | Sequence[str] | None = None) -> FastAPI:
    """An app with the live routes alone, for an in-process engine (no model API)."""
    keys = [api_key] if isinstance(api_key, str) else [k for k in (api_key or []) if k]
    app = FastAPI(title="ParaLLM live view", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    def running():
        if engine.core.dead is not None:
            raise APIError(503, f"the engine is not running: {engine.core.dead}", type="server_error",
                           code="engine_dead")
        return engine

    add_live_routes(app, running, keys)
    return app


_dashboards: dict = {}
_dashboards_lock = threading.Lock()


def serve_dashboard(engine=None, port: int = 0, host: str = "127.0.0.1",
                    api_key: str | Sequence[str] | None = None) -> str:
    """Serve the live page of ``engine`` (default: the shared engine of the default model) from a thread of
    this process, on loopback unless ``host`` says otherwise, and return its URL (``port=0``: a free port).
    One server per engine: a second call returns the first one's URL. :func:`stop_dashboard` ends it."""
    if engine is None:
        from parallm_engine.core.registry import get_engine

        engine = get_engine()
    with _dashboards_lock:
        running = _dashboards.get(id(engine))
        if running is not None and running[0] is engine:
            return running[1].url + "/dashboard"
        srv = ServerThread(live_app(engine, api_key), host=host, port=port).start()
        _dashboards[id(engine)] = (engine, srv)
        return srv.url + "/dashboard"


def stop_dashboard(engine=None) -> bool:
    """Stop the live page :func:`serve_dashboard` started for ``engine`` (None: every one); whether one ran."""
    with _dashboards_lock:
        keys = [k for k, (e, _) in _dashboards.items() if engine is None or e is engine]
        servers = [_dashboards.pop(k)[1] for k in keys]
    for srv in servers:
        srv.stop()
    return bool(servers)
