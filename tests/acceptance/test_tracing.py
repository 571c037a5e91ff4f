"""Trace continuity: a writer's span, the relay's span per event and a consumer's span
make one trace (issue #33); with a span per batch (the default), the consumer continues
from the relay's batch span, which links to each writer's; and the commit→visible
latency histogram on /metrics.

The relay runs in-process but exports as in production, over OTLP/HTTP, to a collector
in this test (``Collector``): the exporter, its batching and the flush at stop are the
real ones, and no hook into the relay's tracer is needed. The writer and the consumer
record their spans with the SDK's in-memory exporter.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as WireSpan
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from relay import Outbox, trace_headers
from relay.daemon import Relay
from tests.acceptance.test_observability import get, sample
from tests.support import consume, order, sub, wait_caught_up

pytestmark = pytest.mark.acceptance


class Collector:
    """An OTLP/HTTP trace receiver on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, WireSpan]] = []  # (service.name, span)
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource.resource.attributes
                        if a.key == "service.name"
                    )
                    for scope in resource.scope_spans:
                        received.extend((service, span) for span in scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector()
    yield server
    server.close()


@pytest.fixture
def app_spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The writer's and the consumer's tracing, as an app would set it up."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _write_in_spans(
    conn: psycopg.Connection[Any], outbox: Outbox, provider: TracerProvider, ids: list[str]
) -> None:
    tracer = provider.get_tracer("writer")
    for i in ids:
        with tracer.start_as_current_span(f"place order {i}"), conn.transaction():
            outbox.append(
                conn,
                aggregate_type="order",
                aggregate_id=i,
                event_type="OrderPlaced",
                payload=order(i),
                headers=trace_headers({"tenant": "t-1"}),
            )


def test_one_trace_from_writer_through_relay_to_consumer(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    collector: Collector,
    app_spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = app_spans
    relay = start_relay(
        subscribers=[sub("s", topic_prefix)],
        tracing=True,
        tracing_spans="event",
        tracing_endpoint=collector.url,
        tracing_service_name="relay-under-test",
        topic_partitions=3,
    )
    ids = ["o-1", "o-2", "o-3", "o-4", "o-5"]
    _write_in_spans(writer_db, outbox, provider, ids)
    wait_caught_up(db, "s")
    seen = consume(kafka_bootstrap, [f"{topic_prefix}outbox.event.order"], expected=len(ids))
    assert len(seen) == len(ids)

    # The consumer continues the trace from the record's headers.
    consumer = provider.get_tracer("consumer")
    propagator = TraceContextTextMapPropagator()
    for record in seen:
        carrier = {k: (v or b"").decode() for k, v in record.headers}
        assert carrier["tenant"] == "t-1"  # the row's other headers pass through
        with consumer.start_as_current_span(
            f"handle {record.message_id}",
            context=propagator.extract(carrier),
            kind=SpanKind.CONSUMER,
        ):
            pass
    metrics = get(relay, "/metrics")[1]
    relay.stop()  # flushes the relay's exporter

    app = exporter.get_finished_spans()
    writers = {s.name.removeprefix("place order "): s for s in app if s.name.startswith("place")}
    consumers = [s for s in app if s.name.startswith("handle")]
    relayed = {_attribute(span, "messaging.message.id"): span for _, span in collector.spans}
    assert {service for service, _ in collector.spans} == {"relay-under-test"}
    assert len(collector.spans) == len(ids), "one relay span per published event"
    by_id = {record.message_id: record for record in seen}
    for handled in consumers:
        message_id = handled.name.removeprefix("handle ")
        record = by_id[message_id]
        writer = writers[(record.key or b"").decode()]
        span = relayed[message_id]
        trace_id = _context(writer)[0]
        # writer → relay → consumer: one trace, each span the child of the one before.
        assert span.trace_id.hex() == trace_id
        assert span.parent_span_id.hex() == _context(writer)[1]
        assert _context(handled)[0] == trace_id
        assert handled.parent is not None and f"{handled.parent.span_id:016x}" == span.span_id.hex()
        assert span.kind == WireSpan.SPAN_KIND_PRODUCER
        assert _attribute(span, "messaging.destination.name") == record.topic
        assert _attribute(span, "messaging.destination.partition.id") == str(record.partition)
        assert float(_attribute(span, "outbox.commit_to_visible_ms")) >= 0
    assert len(consumers) == len(ids)

    # The latency histogram counts every published event.
    count = sample(
        metrics, "outbox_relay_commit_to_visible_seconds_count", subscriber="s", part="0"
    )
    assert count == len(ids)


def test_the_consumer_continues_from_the_batch_span_which_links_each_writer(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    collector: Collector,
    app_spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """The default, a span per batch: writer ← (link) relay batch span → consumer."""
    provider, exporter = app_spans
    ids = ["o-1", "o-2", "o-3", "o-4", "o-5"]
    _write_in_spans(writer_db, outbox, provider, ids)  # before the relay: one backlog
    relay = start_relay(
        subscribers=[sub("s", topic_prefix)],
        tracing=True,
        tracing_endpoint=collector.url,
        tracing_service_name="relay-under-test",
        topic_partitions=3,
    )
    wait_caught_up(db, "s")
    seen = consume(kafka_bootstrap, [f"{topic_prefix}outbox.event.order"], expected=len(ids))
    assert len(seen) == len(ids)
    consumer = provider.get_tracer("consumer")
    propagator = TraceContextTextMapPropagator()
    for record in seen:
        carrier = {k: (v or b"").decode() for k, v in record.headers}
        with consumer.start_as_current_span(
            f"handle {record.message_id}",
            context=propagator.extract(carrier),
            kind=SpanKind.CONSUMER,
        ):
            pass
    relay.stop()  # flushes the relay's exporter

    app = exporter.get_finished_spans()
    writers = {s.name.removeprefix("place order "): s for s in app if s.name.startswith("place")}
    consumers = [s for s in app if s.name.startswith("handle")]
    batches = {span.span_id.hex(): span for _, span in collector.spans}
    assert 1 <= len(batches) < len(ids), "one relay span per published batch"
    linked = [link for span in batches.values() for link in span.links]
    assert len(linked) == len(ids)
    by_id = {record.message_id: record for record in seen}
    for handled in consumers:
        message_id = handled.name.removeprefix("handle ")
        record = by_id[message_id]
        assert handled.parent is not None
        batch = batches[f"{handled.parent.span_id:016x}"]  # the consumer's parent...
        assert _context(handled)[0] == batch.trace_id.hex()
        assert batch.kind == WireSpan.SPAN_KIND_PRODUCER
        assert batch.parent_span_id == b""
        writer = writers[(record.key or b"").decode()]
        [link] = [  # ... links to the writer's span, naming the event
            link
            for link in batch.links
            if (link.trace_id.hex(), link.span_id.hex()) == _context(writer)
        ]
        assert _link_attribute(link, "messaging.message.id") == message_id
        assert _attribute(batch, "messaging.destination.name") == record.topic
        assert record.partition in _partitions(batch)
    assert len(consumers) == len(ids)


def test_without_tracing_the_row_trace_headers_pass_through_and_latency_is_measured(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    app_spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = app_spans
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    _write_in_spans(writer_db, outbox, provider, ["o-1", "o-2"])
    wait_caught_up(db, "s")
    seen = consume(kafka_bootstrap, [f"{topic_prefix}outbox.event.order"], expected=2)
    writers = {s.name.removeprefix("place order "): s for s in exporter.get_finished_spans()}
    for record in seen:
        trace_id, span_id = _context(writers[(record.key or b"").decode()])
        written = (record.header_text("traceparent") or "").split("-")
        assert written[1:3] == [trace_id, span_id]  # as the writer wrote it
    metrics = get(relay, "/metrics")[1]
    assert (
        sample(metrics, "outbox_relay_commit_to_visible_seconds_count", subscriber="s", part="0")
        == 2
    )
    assert (
        sample(
            metrics,
            "outbox_relay_commit_to_visible_seconds_bucket",
            subscriber="s",
            part="0",
            le="+Inf",
        )
        == 2
    )


def _context(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def _attribute(span: WireSpan, key: str) -> str:
    for attribute in span.attributes:
        if attribute.key == key:
            value = attribute.value
            kind = value.WhichOneof("value")
            return str(getattr(value, kind))
    raise AssertionError(f"span {span.name} has no attribute {key}")


def _link_attribute(link: WireSpan.Link, key: str) -> str:
    for attribute in link.attributes:
        if attribute.key == key:
            return str(attribute.value.string_value)
    raise AssertionError(f"the link has no attribute {key}")


def _partitions(span: WireSpan) -> list[int]:
    for attribute in span.attributes:
        if attribute.key == "outbox.partitions":
            return [v.int_value for v in attribute.value.array_value.values]
    raise AssertionError(f"span {span.name} has no partitions")
