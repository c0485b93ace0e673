"""OpenTelemetry spans per request (optional: ``pip install 'parallm-engine[otel]'``; docs/tracing.md).

Off unless the process has set a tracer provider (``opentelemetry.trace.set_tracer_provider``, as LangSmith's,
Langfuse's and Phoenix's OpenTelemetry set-ups do) or ``PARALLM_OTEL=1``; ``PARALLM_OTEL=0`` keeps it off.
Off, a submit costs one dictionary look-up (opentelemetry is never imported by the engine).

On, ``Engine.submit`` opens the request's span in the caller's thread, under the caller's current
OpenTelemetry context (so a LangChain / LangGraph run traced with OpenTelemetry, or a server's request that
continued a W3C ``traceparent``, holds it), starting at the request's arrival. When the request ends (the
lifecycle recorder's ``finished``, ``timeline.py``, on the engine thread) its children are made with the
recorded times: ``queue``, ``prefill`` (cached vs computed prompt tokens) and ``decode``; preemptions are
events; the GenAI semantic conventions' attributes are set and the span ends. Ending a span runs the span
processors on the engine thread: export with a ``BatchSpanProcessor`` (what exporters are for), not a
``SimpleSpanProcessor`` with a slow exporter.
"""

from __future__ import annotations

import sys
import time

from parallm_engine import settings

PROVIDER = "parallm"
_cached: tuple = (None, None)  # (provider, its tracer)


def tracer():
    """The tracer the engine's spans go to, or None when tracing is off."""
    global _cached
    on = settings.otel()
    if on is False:
        return None
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        if not on:
            return None
        try:
            from opentelemetry import trace
        except ImportError:
            return None
    provider = trace.get_tracer_provider()
    if not on and isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None  # no provider set: the API would make non-recording spans
    if _cached[0] is not provider:
        _cached = (provider, provider.get_tracer("parallm_engine"))
    return _cached[1]


class RequestSpan:
    """A request's span while it runs (``Request.span``); :meth:`end` adds its phases and ends it."""

    def __init__(self, tracer, req, model: str, operation: str = "text_completion"):
        from opentelemetry.trace import SpanKind

        self._tracer = tracer
        self._req = req
        # monotonic seconds -> Unix nanoseconds, as the SDK takes explicit times
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        p = req.params
        attributes = {"gen_ai.operation.name": operation, "gen_ai.system": PROVIDER,
                      "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
                      "gen_ai.response.model": model, "gen_ai.response.id": req.id}
        for key, value in (("max_tokens", p.max_tokens), ("temperature", p.temperature), ("top_p", p.top_p),
                           ("seed", p.seed)):
            if value is not None:
                attributes[f"gen_ai.request.{key}"] = value
        if p.n != 1:
            attributes["gen_ai.request.choice.count"] = p.n
        if req.session is not None:
            attributes["parallm.session"] = req.session
        self.span = tracer.start_span(f"{operation} {model}", kind=SpanKind.INTERNAL, attributes=attributes,
                                      start_time=self._ns(req.arrival))

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def end(self, rec) -> None:
        """The request ended (``rec``: its ``timeline.RequestRecord``): its phases as children, then it."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        span, req, self._req = self.span, self._req, None
        parent = set_span_in_context(span)
        admitted = rec.admitted if rec.admitted is not None else rec.finish
        first = rec.first_token if rec.first_token is not None else rec.finish
        computed = max(rec.prompt_tokens - rec.cached_tokens, 0)
        for name, t0, t1, attrs in (
            ("queue", rec.arrival, admitted, {}),
            ("prefill", admitted, first, {"gen_ai.usage.input_tokens": rec.prompt_tokens,
                                          "gen_ai.usage.cache_read.input_tokens": rec.cached_tokens,
                                          "parallm.prefill.cached_tokens": rec.cached_tokens,
                                          "parallm.prefill.computed_tokens": computed}),
            ("decode", first, rec.finish, {"gen_ai.usage.output_tokens": rec.output_tokens}),
        ):
            if rec.admitted is None and name != "queue":
                break  # it never left the queue
            child = self._tracer.start_span(name, context=parent, start_time=self._ns(t0), attributes=attrs)
            child.end(end_time=self._ns(max(t1, t0)))
        for t in rec.preemptions:
            span.add_event("preempted", timestamp=self._ns(t))
        reasons = [s.finish_reason for s in req.sequences if getattr(s, "finish_reason", None)] or \
            [rec.finish_reason]
        span.set_attributes({
            "gen_ai.usage.input_tokens": rec.prompt_tokens, "gen_ai.usage.output_tokens": rec.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": rec.cached_tokens,
            "gen_ai.response.finish_reasons": reasons if not rec.aborted else ["abort"],
            "parallm.queue_s": max(admitted - rec.arrival, 0.0), "parallm.preemptions": len(rec.preemptions),
        })
        if rec.aborted:
            span.set_attribute("error.type", "aborted")
            span.set_status(Status(StatusCode.ERROR, "the request was aborted"))
        span.end(end_time=self._ns(rec.finish))


def request_span(req, model: str):
    """``req``'s span when tracing is on (its caller's thread, at submit), else None."""
    t = tracer()
    return None if t is None else RequestSpan(t, req, model)
