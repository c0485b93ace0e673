"""The caller's OpenTelemetry trace goes with a ``base_url=`` call: its current span as W3C ``traceparent`` /
``tracestate`` headers, so a ParaLLM server (which continues them) puts its request spans under the
LangChain / LlamaIndex run that made the call (docs/tracing.md). Nothing is sent, and opentelemetry is never
imported, when the process does not use it; ``PARALLM_OTEL=0`` turns it off."""

from __future__ import annotations

import os
import sys

_OFF = {"0", "false", "no", "off"}


def trace_headers() -> dict[str, str]:
    """The current context's propagation headers ({} without a current span, or without OpenTelemetry)."""
    if "opentelemetry.trace" not in sys.modules or os.environ.get("PARALLM_OTEL", "").strip().lower() in _OFF:
        return {}
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
