"""The live view's routes (issue 76): ``GET /v1/status`` (JSON), ``GET /v1/status/stream`` (the same as
server-sent events) and the live page ``GET /dashboard`` with its static files, on ``parallm serve`` and, on
request, on an in-process engine (:func:`serve_dashboard`, loopback by default). What they show is
:class:`parallm_engine.core.live_status.LiveStatus`'s snapshot; ``docs/observability.md`` describes it.

With API keys, every route here needs one: ``Authorization: Bearer KEY`` / ``x-api-key`` like the API, or (a
browser's ``EventSource`` sends no headers) the ``key`` query parameter or the ``parallm_key`` cookie, which
``/dashboard?key=KEY`` sets. Unknown or malformed query parameters answer 400; a stopped engine 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from importlib import resources
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from parallm_engine.core.live_status import live_status
from parallm_engine.errors import EngineDeadError
from parallm_engine.serve.openai_format import APIError

SECTIONS = ("engine", "requests", "timeline", "tree", "history")
COOKIE = "parallm_key"
#: The page's files (package data: ``serve/dashboard``), by the name the page asks for, and their types.
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
          "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "LICENSE": "text/plain"}
_ASSET_DIRS = {"uPlot.iife.min.js": "uplot", "uPlot.min.css": "uplot", "LICENSE": "uplot"}


def _query(request: Request, allowed: dict[str, Callable[[str], object]]) -> dict:
    """The query parameters, each parsed by its function (ValueError: 400 naming it); others: 400."""
    out = {}
    for name, value in request.query_params.multi_items():
        parse = allowed.get(name)
        if parse is None:
            raise APIError(400, f"unknown query parameter {name!r}; this route takes {sorted(allowed)}",
                           param=name, code="unknown_parameter")
        if name in out:
            raise APIError(400, f"query parameter {name!r} is given twice", param=name)
        try:
            out[name] = parse(value)
        except ValueError as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from None
    return out


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(s for s in (p.strip() for p in text.split(",")) if s)
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise ValueError(f"must be a comma-separated list of {', '.join(SECTIONS)}")
    return names


def _bounded(lo: float, hi: float, kind=float):
    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise ValueError(f"must be a {'number' if kind is float else 'whole number'}") from None
        if not lo <= value <= hi:  # (NaN fails this too)
            raise ValueError(f"must be between {lo} and {hi}")
        return value
    return parse


_STATUS_QUERY = {"sections": _sections, "limit": _bounded(1, 100_000, int), "key": str}
_STREAM_QUERY = {**_STATUS_QUERY, "interval": _bounded(0.2, 60.0)}


def _trimmed(snap: dict, sections: Sequence[str], limit: int | None) -> dict:
    out = {"time": snap["time"]}
    for name in sections:
        value = snap[name]
        if limit is not None and name in ("requests", "timeline") and isinstance(value, list):
            value = value[-limit:]
        out[name] = value
    return out


def add_live_routes(app: FastAPI, get_engine: Callable[[], object], api_keys: Sequence[str]) -> None:
    """The routes on ``app``: ``get_engine()`` returns the running engine or raises ``APIError`` (503)."""

    def valid(token: str, encoding: str = "utf-8") -> bool:
        """``token`` is one of the keys (compared as bytes, with every key: no early exit on a match). Headers
        and cookies arrive as latin-1 text, query parameters as UTF-8."""
        raw = token.encode(encoding, "replace")
        return bool(token) and any([hmac.compare_digest(raw, k.encode()) for k in api_keys])

    def check_key(request: Request) -> None:
        if not api_keys:
            return
        given = request.headers.get("authorization", "")
        header = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if header:
            ok = valid(header, "latin-1")
        elif "key" in request.query_params:
            ok = valid(request.query_params["key"])
        else:
            ok = valid(request.cookies.get(COOKIE, ""), "latin-1")
        if not ok:
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>', or open "
                                "/dashboard?key=<key>.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def snapshot(engine, max_age: float) -> dict:
        try:
            return await asyncio.to_thread(live_status(engine).snapshot, max_age=max_age)
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead") from None
        except TimeoutError:  # the engine thread did not reach a step boundary in time
            raise APIError(503, "the engine is busy: no snapshot in time; retry", type="server_error",
                           code="engine_busy", headers={"Retry-After": "1"}) from None

    @app.get("/v1/status", include_in_schema=True)
    async def status(request: Request, sections: str | None = None, limit: str | None = None,
                     key: str | None = None):  # (declared for the schema; parsed by _query)
        """The engine and every request in flight, now (``docs/observability.md``). ``sections``: a
        comma-separated subset of engine, requests, timeline, tree, history (default all); ``limit``: the most
        requests / timeline records (the latest)."""
        check_key(request)
        q = _query(request, _STATUS_QUERY)
        snap = await snapshot(get_engine(), 0.0)  # one caller's question: a fresh look
        return JSONResponse(_trimmed(snap, q.get("sections", SECTIONS), q.get("limit")))

    @app.get("/v1/status/stream", include_in_schema=False)  # endless: not for schema fuzzers
    async def status_stream(request: Request):
        """``/v1/status`` as server-sent events (``event: status``), every ``interval`` seconds (default 0.5)."""
        check_key(request)
        q = _query(request, _STREAM_QUERY)
        engine = get_engine()
        sections, limit, interval = q.get("sections", SECTIONS), q.get("limit"), q.get("interval", 0.5)

        async def events():
            yield "retry: 1000\n\n"  # the browser reconnects a second after the server went away
            while not await request.is_disconnected():
                try:  # every viewer of the stream shares one look per MIN_INTERVAL_S
                    snap = await asyncio.to_thread(live_status(engine).snapshot)
                except EngineDeadError as exc:
                    yield f"event: engine_dead\ndata: {json.dumps({'message': str(exc)})}\n\n"
                    return
                except TimeoutError:  # a long step: the next interval tries again
                    await asyncio.sleep(interval)
                    continue
                yield f"event: status\ndata: {json.dumps(_trimmed(snap, sections, limit))}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        check_key(request)
        q = _query(request, {"key": str})
        page = HTMLResponse(_asset("index.html"), headers={"Cache-Control": "no-store"})
        if api_keys and valid(q.get("key", "")):  # the page's own requests (EventSource, assets) then carry it
            page.set_cookie(COOKIE, q["key"], httponly=True, samesite="strict", path="/")
        return page

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str, request: Request):
        check_key(request)
        _query(request, {"key": str})
        if name not in ASSETS:
            raise APIError(404, "no such file of the live page", code="not_found")
        return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


def _asset(name: str) -> bytes:
    folder = resources.files("parallm_engine.serve") / "dashboard"
    if name in _ASSET_DIRS:
        folder = folder / _ASSET_DIRS[name]
    return (folder / name).read_bytes()
