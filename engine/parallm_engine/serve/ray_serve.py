"""``parallm serve --ray``: N replicas of the engine on Ray Serve behind one front that routes by cached prefix
and session (docs/scale-out.md).

Two deployments:

- :class:`ParaLLMReplica` (N of them, or ``--min-replicas``..``--max-replicas`` autoscaled on requests in
  flight): one engine each, serving ``parallm serve``'s own FastAPI app (:func:`~parallm_engine.serve.server.create_app`:
  the same routes, keys, queue shares, limits and errors); the front hands it whole HTTP requests and it streams
  the app's answer back, adding ``x-parallm-replica``.
- :class:`ParaLLMFront` (one, on ``--port``): reads each request once, computes its routing key
  (:mod:`~parallm_engine.serve.ray_routing`) and calls the replicas through a handle whose Ray Serve request router
  (:mod:`~parallm_engine.serve.ray_router`) picks the replica. ``/metrics`` is every replica's metrics with a
  ``replica`` label plus the router's; ``/replicas`` says who is live and what the router did.

Faults: a replica that dies is replaced by Ray (it also restarts one whose engine stopped: ``check_health``).
A request that had sent nothing to its client when its replica died is sent again, to another replica
(``retries`` times); a stream already under way ends with a typed error event in its API's shape
(``replica_died``), so the front never hangs on a dead replica.

Users with their own Ray Serve app::

    serve run parallm_engine.serve.ray_serve:app                        # 2 replicas of the default model
    serve run parallm_engine.serve.ray_serve:app_builder replicas=4 model=org/name
    serve.run(build_app(model, replicas=4))                             # from Python
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Sequence

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from parallm_engine.serve.anthropic_format import anthropic_error, is_anthropic_path
from parallm_engine.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from parallm_engine.serve.openai_format import SSE_DONE, APIError, dumps, sse
from parallm_engine.serve.ray_routing import DEFAULT_SLACK, LRU, TABLES, ForwardedRequest, response_ids, routing_fields

REPLICA_HEADER = "x-parallm-replica"
#: Environment the replicas inherit from the process that builds the app (on a cluster they start elsewhere).
FORWARDED_ENV_PREFIXES = ("PARALLM_", "MLX_", "HF_", "HUGGINGFACE_")
_HOP_BY_HOP = {b"connection", b"transfer-encoding", b"keep-alive"}


# ----------------------------------------------------------------------------------------------
# A replica: parallm serve's app on one engine
# ----------------------------------------------------------------------------------------------


class ParaLLMReplica:
    """One engine and ``parallm serve``'s app on it, answering the requests the front forwards."""

    def __init__(self, model=None, engine_config: dict | None = None, app_config: dict | None = None):
        import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
        from parallm_engine.core.registry import get_engine
        from parallm_engine.serve.server import create_app

        self.engine = get_engine(model, **dict(engine_config or {}))
        self.app = create_app(engine=self.engine, model=model, **dict(app_config or {}))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._finishing: set[asyncio.Task] = set()

    async def forward(self, req: ForwardedRequest):
        """Run ``req`` through the app: ``{"status", "headers", "replica"}`` first, then the body's chunks. Closed
        early (the front's client went, or it was cancelled), the app sees its client disconnect and aborts
        the engine request."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
                 "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
                 "client": ("127.0.0.1", 0), "server": ("parallm-replica", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        app_task = asyncio.ensure_future(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:  # the app ended without finishing its answer
                    if app_task.exception() is not None:
                        raise app_task.exception()
                    return
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                    yield {"status": message["status"], "headers": headers, "replica": self.replica_id}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()  # a stream still running sees its client go and aborts its engine request
            if not app_task.done():
                self._finishing.add(app_task)
                app_task.add_done_callback(self._finishing.discard)

    async def _get(self, path: str) -> bytes:
        chunks = []
        async for item in self.forward(ForwardedRequest("GET", path, b"", [], b"")):
            if isinstance(item, bytes):
                chunks.append(item)
        return b"".join(chunks)

    async def metrics_text(self) -> tuple[str, str]:
        """This replica's ``/metrics`` (the front adds the ``replica`` label)."""
        return self.replica_id, (await self._get("/metrics")).decode()

    def describe(self) -> dict:
        import ray

        state = self.app.state.parallm
        return {"replica": self.replica_id, "node": ray.get_runtime_context().get_node_id(),
                "model": state.model_name, "healthy": state.healthy()}

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine stopped is replaced."""
        if not self.app.state.parallm.healthy():
            raise RuntimeError("the engine is not running")


# ----------------------------------------------------------------------------------------------
# The front
# ----------------------------------------------------------------------------------------------


def _error(err: APIError, path: str) -> Response:
    return anthropic_error(err) if is_anthropic_path(path) else err.response()


def stream_error_event(path: str, err: APIError) -> bytes:
    """The in-band error a stream of ``path``'s API ends with (the shape each API's own streams use)."""
    if is_anthropic_path(path):
        detail = anthropic_error(err).body.decode()
        return f"event: error\ndata: {detail}\n\n".encode()
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": err.code, "message": err.message, "param": err.param, **err.body()}
        return f"event: error\ndata: {dumps(data)}\n\n".encode()
    return (sse(err.body()) + SSE_DONE).encode()


def _labelled(line: str, replica: str) -> str:
    """A Prometheus sample line with ``replica="..."`` as its first label."""
    name = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
    if name is None:
        return line
    end = name.end()
    label = f'replica="{replica}"'
    if line[end:end + 1] == "{":
        rest = line[end + 1:]
        return f"{line[:end]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{line[:end]}{{{label}}}{line[end:]}"


def merge_metrics(texts: dict[str, str]) -> str:
    """Several replicas' Prometheus text as one exposition: each family once (its HELP and TYPE), with every
    replica's samples labelled ``replica``."""
    families: dict[str, dict[str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        current = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                current = line.split()[2]
                meta = families.setdefault(current, {"meta": [], "samples": []})["meta"]
                if not any(m.split()[:3] == line.split()[:3] for m in meta):
                    meta.append(line)
            elif line and not line.startswith("#"):
                name = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
                family = current if current and name and name.group(0).startswith(current) else \
                    (name.group(0) if name else "")
                families.setdefault(family, {"meta": [], "samples": []})["samples"].append(_labelled(line, replica))
    out = []
    for fam in families.values():
        out += fam["meta"] + fam["samples"]
    return "\n".join(out) + "\n"


class ParaLLMFront:
    """The one HTTP front: routes each request to a replica (the router reads its key) and relays the answer."""

    def __init__(self, replicas, max_body_bytes: int = 32 << 20, retries: int = 2, metrics_timeout_s: float = 10.0):
        self.handle = replicas.options(stream=True)  # one handle: one router, one routing table
        self.max_body_bytes = max_body_bytes
        self.retries = retries
        self.metrics_timeout_s = metrics_timeout_s
        self.responses = LRU(100_000)  # stored response id -> the replica that holds it
        self.retried = 0
        self.stream_errors = 0

    def _table(self):
        return TABLES.get((self.handle.app_name, self.handle.deployment_name))

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/metrics":
            return Response(await self.metrics(), media_type=METRICS_CONTENT_TYPE)
        if request.method == "GET" and path == "/replicas":
            return JSONResponse(await self.replicas())
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(APIError(413, f"request body is larger than {self.max_body_bytes} bytes",
                                       code="request_too_large"), path)
        headers = {k.lower(): v for k, v in request.headers.items()}
        blocks, session, stored = routing_fields(path, headers, bytes(body))
        target = self.responses.get(stored) if stored else None
        req = ForwardedRequest(request.method, path, request.url.query.encode(), list(request.headers.raw),
                               bytes(body), blocks, session, target)
        return await self.forward(req)

    async def forward(self, req: ForwardedRequest) -> Response:
        """Send ``req`` to a replica; while nothing has reached the client, a replica's death sends it again."""
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            gen = self.handle.forward.remote(req)
            try:
                start = await gen.__anext__()
                first = await anext(gen, None)
            except RayActorError as exc:  # died (or unreachable) before answering: nothing sent yet
                last = exc
                self.retried += 1
                gen.cancel()
                await asyncio.sleep(0.2 * (attempt + 1))  # time for Ray to mark the replica dead
                continue
            except StopAsyncIteration:
                return _error(APIError(502, "the replica ended the request without an answer", type="server_error",
                                       code="replica_no_answer"), req.path)
            return self._relay(req, start, first, gen)
        return _error(APIError(503, f"no replica could take the request ({type(last).__name__}: {last})",
                               type="server_error", code="replica_died"), req.path)

    def _relay(self, req: ForwardedRequest, start: dict, first: bytes | None, gen) -> Response:
        replica = start["replica"]
        if req.path.startswith("/v1/responses") and first:
            for rid in response_ids(first[:4096]):
                self.responses.put(rid, replica)
        headers = [(k, v) for k, v in start["headers"] if k.lower() not in _HOP_BY_HOP]
        streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)

        async def body():
            try:
                if first:
                    yield first
                async for chunk in gen:
                    yield chunk
            except RayActorError:
                self.stream_errors += 1
                if not streaming:
                    raise  # a JSON body cut short: the connection drops, the client sees an incomplete answer
                yield stream_error_event(req.path, APIError(
                    503, f"replica {replica} died while streaming this response; send the request again",
                    type="server_error", code="replica_died"))
            finally:
                gen.cancel()  # the client went, or the stream ended: the replica's generator stops

        response = StreamingResponse(body(), status_code=start["status"])
        response.raw_headers = headers
        return response

    async def _broadcast(self, method: str) -> list[Any]:
        try:
            results = await self.handle.broadcast(method).results_async(timeout_s=self.metrics_timeout_s,
                                                                         return_exceptions=True)
        except (TimeoutError, RuntimeError):
            return []
        return [r for r in results if not isinstance(r, BaseException)]

    async def metrics(self) -> str:
        texts = dict(await self._broadcast("metrics_text"))
        lines = [merge_metrics(texts).rstrip("\n")] if texts else []
        lines += ["# HELP parallm_front_replicas Replicas that answered this scrape.",
                  "# TYPE parallm_front_replicas gauge", f"parallm_front_replicas {len(texts)}",
                  "# HELP parallm_front_retries_total Requests sent again after their replica died before answering.",
                  "# TYPE parallm_front_retries_total counter", f"parallm_front_retries_total {self.retried}",
                  "# HELP parallm_front_stream_errors_total Answers cut short by their replica's death.",
                  "# TYPE parallm_front_stream_errors_total counter",
                  f"parallm_front_stream_errors_total {self.stream_errors}"]
        table = self._table()
        if table is not None:
            snap = table.snapshot()
            lines += ["# HELP parallm_router_requests_total Requests routed, by replica and reason.",
                      "# TYPE parallm_router_requests_total counter"]
            lines += [f'parallm_router_requests_total{{replica="{d["replica"]}",reason="{d["reason"]}"}} '
                      f'{d["requests"]}' for d in snap["decisions"]]
            lines += ["# HELP parallm_router_in_flight Requests in flight per replica, as the router counts them.",
                      "# TYPE parallm_router_in_flight gauge"]
            lines += [f'parallm_router_in_flight{{replica="{r}"}} {v["in_flight"]}' for r, v in snap["replicas"].items()]
        return "\n".join(lines) + "\n"

    async def replicas(self) -> dict:
        table = self._table()
        described = sorted(await self._broadcast("describe"), key=lambda d: d["replica"])
        return {"replicas": described, "router": table.snapshot() if table is not None else None,
                "retried": self.retried, "stream_errors": self.stream_errors}


# ----------------------------------------------------------------------------------------------
# Building the app
# ----------------------------------------------------------------------------------------------


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def build_app(model=None, replicas: int = 2, *, min_replicas: int | None = None, max_replicas: int | None = None,
              target_ongoing_requests: float = 32.0, api_key: str | Sequence[str] | None = None,
              served_model_name: str | list[str] | None = None, expose_docs: bool = False,
              max_request_share: float | None = None, max_key_share: float | None = None,
              max_body_bytes: int = 32 << 20, routing: str = "prefix", slack: int = DEFAULT_SLACK, replica_cpus: float = 1.0,
              replica_gpus: float = 0.0, max_ongoing_requests: int = 1024, retries: int = 2,
              health_check_period_s: float = 5.0, engine_config: dict | None = None,
              autoscaling: dict | None = None):
    """The Ray Serve application: ``replicas`` engines (or ``min_replicas``..``max_replicas``, autoscaled to keep
    ``target_ongoing_requests`` in flight per replica) behind one front. ``routing``: ``prefix`` (longest
    recorded prefix, session, least loaded) or ``round_robin`` (for comparison). ``slack``: requests in flight a
    replica may carry above the least loaded one and still win by affinity. ``replica_cpus`` / ``replica_gpus``:
    each replica's Ray resources (Ray places replicas by them: ``replica_gpus=1`` puts one per GPU). The server
    options (``api_key``, ``served_model_name``, ``expose_docs``, the queue shares, ``max_body_bytes``) are
    :func:`~parallm_engine.serve.server.create_app`'s, applied on every replica; ``engine_config`` goes to
    ``get_engine``. Environment variables named ``PARALLM_*``, ``MLX_*``, ``HF_*`` travel to the replicas."""
    from parallm_engine.errors import InvalidRequestError
    from parallm_engine.serve.ray_routing import POLICIES

    if routing not in POLICIES:
        raise InvalidRequestError(f"routing must be one of {POLICIES}, got {routing!r}", param="routing")
    if (min_replicas is None) != (max_replicas is None):
        raise InvalidRequestError("autoscaling needs both min_replicas and max_replicas", param="max_replicas")
    if min_replicas is not None and not 0 <= min_replicas <= max_replicas or \
            max_replicas is not None and max_replicas < 1 or replicas < 1:
        raise InvalidRequestError(f"need 1 <= replicas and 0 <= min_replicas <= max_replicas >= 1, got replicas="
                                  f"{replicas}, min_replicas={min_replicas}, max_replicas={max_replicas}",
                                  param="replicas")
    app_config: dict[str, Any] = {"api_key": api_key, "served_model_name": served_model_name,
                                  "expose_docs": expose_docs, "max_body_bytes": max_body_bytes}
    if max_request_share is not None:
        app_config["max_request_share"] = max_request_share
    if max_key_share is not None:
        app_config["max_key_share"] = max_key_share
    scale: dict[str, Any] = {"num_replicas": replicas}
    if max_replicas is not None:
        scale = {"autoscaling_config": AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                                         target_ongoing_requests=target_ongoing_requests,
                                                         **(autoscaling or {}))}
    router = RequestRouterConfig(request_router_class="parallm_engine.serve.ray_router.PrefixAffinityRouter",
                                 request_router_kwargs={"policy": routing, "slack": slack})
    replica = serve.deployment(ParaLLMReplica, name="ParaLLMReplica").options(
        max_ongoing_requests=max_ongoing_requests, request_router_config=router,
        health_check_period_s=health_check_period_s,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus,
                           "runtime_env": {"env_vars": _forwarded_env()}},
        **scale)
    front = serve.deployment(ParaLLMFront, name="ParaLLMFront").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    return front.bind(replica.bind(model, dict(engine_config or {}), app_config), max_body_bytes=max_body_bytes,
                      retries=retries)


_INT_ARGS = ("replicas", "min_replicas", "max_replicas", "slack", "max_ongoing_requests", "retries", "max_body_bytes")
_FLOAT_ARGS = ("target_ongoing_requests", "replica_cpus", "replica_gpus", "max_request_share", "max_key_share",
               "health_check_period_s")


def app_builder(args: dict[str, str]):
    """``serve run parallm_engine.serve.ray_serve:app_builder replicas=4 model=...``: :func:`build_app` from the
    command line's ``key=value`` arguments."""
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        kwargs[key] = int(value) if key in _INT_ARGS else float(value) if key in _FLOAT_ARGS else value
    return build_app(**kwargs)


def __getattr__(name: str):
    if name == "app":  # ``serve run parallm_engine.serve.ray_serve:app``: built when asked for, not on import
        return build_app()
    raise AttributeError(name)
