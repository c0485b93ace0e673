"""The server continues a caller's W3C trace (``traceparent`` / ``tracestate`` headers): while tracing is on
(``core/tracing.py``), a request that carries one is handled under the context they name, so the engine's
request spans are children of the caller's span (a ``base_url=`` client sends its current span's).

Pure ASGI middleware; the headers are read by OpenTelemetry's configured propagator (W3C trace context by
default). A malformed header only leaves the request without a parent, as the propagator decides."""

from __future__ import annotations

from parallm_engine.core.tracing import tracer


class TraceContext:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not any(name == b"traceparent" for name, _ in scope.get("headers", ())) \
                or tracer() is None:
            return await self.app(scope, receive, send)
        from opentelemetry import context, propagate

        carrier = {}
        for name, value in scope["headers"]:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode("latin-1")] = value.decode("latin-1")
        token = context.attach(propagate.extract(carrier))
        try:
            return await self.app(scope, receive, send)
        finally:
            context.detach(token)
