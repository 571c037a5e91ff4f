"""The writer's side of trace continuity: the current OpenTelemetry span's W3C trace
context, put in an event's headers, which the relay continues from when it publishes
the event (relay/observability/tracing.py)."""

from __future__ import annotations

from collections.abc import Mapping

from relay.core.model import TRACE_HEADERS


def trace_headers(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus the current OpenTelemetry span's W3C ``traceparent`` (and
    ``tracestate``), for :meth:`relay.Outbox.append`: the relay's span for the event
    becomes a child of the writer's. Without an active span, or without OpenTelemetry
    installed, ``headers`` as they are."""
    found = dict(headers or {})
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return found
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    if carrier:
        found = {k: v for k, v in found.items() if k not in TRACE_HEADERS} | carrier
    return found
