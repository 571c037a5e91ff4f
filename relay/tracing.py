"""Trace continuity (OpenTelemetry) and the commit→visible latency of published events.

With ``tracing = true`` every record the relay publishes gets a PRODUCER span of its own,
a child of the W3C ``traceparent`` the row's headers carry (the writer's span: see
:func:`trace_headers`), or a new trace's root when the row has none. The record's
``traceparent``/``tracestate`` headers are replaced by the new span's, so a consumer
continues the trace from the relay's span. The span starts when the record is encoded
and ends once its batch is committed in Kafka (visible to ``read_committed`` consumers);
it carries the event id, topic, partition and the commit→visible latency. Spans go out
over OTLP/HTTP in a background thread (the SDK's batch processor).

OpenTelemetry is imported only when tracing is on: with it off, the relay pays for the
latency histogram alone (:class:`PublishHook`), one bucket increment per event.

"Commit" time: the row's ``occurred_at`` column, which defaults to ``now()`` -- the start
of the writer's transaction, as Postgres has no commit time without
``track_commit_timestamp`` (which the relay does not require). The latency is therefore
an upper bound: it includes the writer's transaction itself. A writer that sets
``occurred_at`` itself moves it; a value in the future counts as 0.
"""

from __future__ import annotations

import bisect
import logging
import random
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relay.encoding import RecordEncoder
from relay.model import KafkaRecord, OutboxEvent

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from relay.settings import Settings
    from relay.subscribers import Subscriber

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})

# Seconds; Prometheus's own defaults stretched to 5 min, as a relay catching up on a
# backlog publishes events minutes old.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Keys of a part's statistics (relay/daemon/parts.py) that carry the histogram, which
# the /metrics collector turns back into one (relay/metrics.py).
LATENCY_KEY = "commit_to_visible"
_BUCKET_KEYS = (*(f"{LATENCY_KEY}_le_{b}" for b in LATENCY_BUCKETS), f"{LATENCY_KEY}_le_+Inf")
# The sum in whole microseconds: statistics are integer counters.
SUM_KEY, COUNT_KEY = f"{LATENCY_KEY}_sum_us", f"{LATENCY_KEY}_count"
# Spans started for records that were never committed (a batch read ahead then dropped,
# a batch failed and read again after recovery) are forgotten, oldest first, beyond this
# many: they are simply not exported. Bounds the memory they hold (a span is about 1 KB)
# while leaving room for ten full batches in flight.
_MAX_PENDING = 50_000
# At stop: how long the last spans may take to leave (a collector that is down must not
# hold the relay's shutdown).
_FLUSH_TIMEOUT_MS = 5000
# How long a topic's partition count is trusted (partitions can be added).
_PARTITIONS_TTL_S = 60.0


class CommitLatency:
    """A cumulative histogram of commit→visible latencies (non-cumulative buckets; the
    collector adds them up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum_us = 0

    def observe(self, latencies: Iterable[float]) -> None:
        with self._lock:
            for seconds in latencies:
                self._buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
                self._sum_us += int(seconds * 1e6)

    def counts(self) -> dict[str, int]:
        """The histogram as statistics keys (they add up across workers and processes)."""
        with self._lock:
            found = dict(zip(_BUCKET_KEYS, self._buckets, strict=True))
            found[SUM_KEY] = self._sum_us
            found[COUNT_KEY] = sum(self._buckets)
        return found


def latency_of(event: OutboxEvent, now: float) -> float:
    """Seconds from the event's commit (its ``occurred_at``) to ``now``; never negative."""
    return max(0.0, now - event.occurred_at.timestamp())


class PublishHook:
    """Called by a part's worker once per committed batch. Without tracing it records
    the latency histogram only; with it, it also ends the batch's spans."""

    def __init__(self, tracer: RelayTracer | None = None) -> None:
        self.latency = CommitLatency()
        self._tracer = tracer

    def published(
        self, events: Sequence[OutboxEvent], records: Sequence[KafkaRecord], subscriber: Subscriber
    ) -> None:
        """``records`` of ``events`` are committed (visible) now."""
        now = time.time()
        self.latency.observe(latency_of(e, now) for e in events if subscriber.matches(e))
        if self._tracer is not None:
            self._tracer.finish(records, now)

    def counts(self) -> dict[str, int]:
        return self.latency.counts()


class Tracing:
    """What the relay process holds: the tracer (None: tracing off) and its provider."""

    def __init__(self, tracer: RelayTracer | None = None) -> None:
        self.tracer = tracer

    @classmethod
    def start(cls, settings: Settings) -> Tracing:
        if not settings.tracing:
            return cls()
        return cls(RelayTracer.from_settings(settings))

    def wrap(self, encoder: RecordEncoder) -> RecordEncoder:
        """``encoder``, or with tracing on, one that also starts each record's span."""
        if self.tracer is None:
            return encoder
        return TracingEncoder(encoder, self.tracer)

    def hook(self) -> PublishHook:
        """A new part worker's hook."""
        return PublishHook(self.tracer)

    def flush(self) -> None:
        """Export the spans ended so far, and let go of the metadata client (at stop)."""
        if self.tracer is not None:
            self.tracer.flush()


class RelayTracer:
    """Starts a span per record as it is encoded, and ends it once committed."""

    def __init__(
        self,
        provider: TracerProvider,
        partitions: Callable[[str], int | None],
        *,
        sample_ratio: float = 1.0,
    ) -> None:
        """``provider`` should record every span it is asked for (``ParentBased(ALWAYS_ON)``):
        the sampling decision is made here, before it, so that an event that is not
        recorded costs a header and no span object at all."""
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind, get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._root = Context()  # a row without a traceparent: a new trace
        self._span_of = get_current_span
        self._sample_ratio = sample_ratio
        self._producer = SpanKind.PRODUCER
        self._provider = provider
        self._tracer: Tracer = provider.get_tracer("outbox-relay")
        self._propagator = TraceContextTextMapPropagator()
        self._partitions = partitions
        # traceparent header written -> (its span, the event's commit time in seconds)
        self._pending: dict[bytes, tuple[Span, float]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> RelayTracer:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

        provider = TracerProvider(
            resource=Resource.create({"service.name": settings.tracing_service_name}),
            sampler=ParentBased(ALWAYS_ON),  # start() samples
        )
        # None: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else http://localhost:4318/v1/traces.
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.tracing_endpoint))
        )
        admin = {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
        return cls(provider, PartitionCounts(admin), sample_ratio=settings.tracing_sample_ratio)

    def start(self, event: OutboxEvent, record: KafkaRecord) -> KafkaRecord:
        """``record`` with its span's context in place of the row's trace headers.

        Sampling is parent-based: a row whose writer sampled its trace gets a recorded
        span; one whose writer did not gets none, and its headers pass as they are (the
        writer's context, which a consumer continues, unrecorded too); a row without a
        traceparent starts a trace recorded at ``sample_ratio``, or passes as it is. An
        event that is not recorded costs a check and no span, nor any header."""
        carrier = _trace_carrier(event.headers)
        parent = self._root
        if carrier:
            if _unsampled(carrier):
                return record
            parent = self._propagator.extract(carrier)
            writer = self._span_of(parent).get_span_context()
            if writer.is_valid and not writer.trace_flags.sampled:
                return record
        elif self._sample_ratio < 1.0 and random.random() >= self._sample_ratio:
            return record
        # Attributes cost per span, twice (set, then exported): only what the issue asks
        # for, and what finding the event needs (its id; its position is in its headers).
        span = self._tracer.start_span(
            f"{record.topic} publish",
            context=parent,
            kind=self._producer,
            attributes={
                "messaging.system": "kafka",
                "messaging.destination.name": record.topic,
                "messaging.message.id": str(event.message_id),
            },
        )
        # W3C trace context, written here rather than by the propagator (a third of the
        # cost of a span went into building contexts for it).
        context = span.get_span_context()
        traceparent = (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}".encode()
        )
        trace = [(TRACEPARENT, traceparent)]
        if context.trace_state:
            trace.append((TRACESTATE, context.trace_state.to_header().encode()))
        if span.is_recording():
            self._remember(traceparent, span, event.occurred_at.timestamp())
        return _with_headers(record, trace)

    def finish(self, records: Sequence[KafkaRecord], now: float) -> None:
        """End the spans of ``records``, committed at ``now``."""
        end_ns = int(now * 1e9)
        for record in records:
            written = record.header(TRACEPARENT)
            if not isinstance(written, bytes):
                continue  # a dead letter (no span of its own)
            started = self._pending.pop(written, None)
            if started is None:
                continue  # not sampled
            span, committed_at = started
            span.set_attribute("outbox.commit_to_visible_ms", max(0.0, now - committed_at) * 1e3)
            partition = self._partition(record)
            if partition is not None:
                span.set_attribute("messaging.destination.partition.id", str(partition))
            span.end(end_time=end_ns)

    def flush(self) -> None:
        self._provider.force_flush(_FLUSH_TIMEOUT_MS)
        if isinstance(self._partitions, PartitionCounts):
            self._partitions.close()

    def _remember(self, traceparent: bytes, span: Span, committed_at: float) -> None:
        pending = self._pending
        pending[traceparent] = (span, committed_at)
        while len(pending) > _MAX_PENDING:  # the oldest were dropped unpublished
            try:
                del pending[next(iter(pending))]
            except (StopIteration, RuntimeError, KeyError):  # another worker got there
                break

    def _partition(self, record: KafkaRecord) -> int | None:
        """The producer's partition for ``record``: the one its subscriber chose (routing
        control), else murmur2_random's, as Java's client."""
        if record.partition is not None:
            return record.partition
        if record.key is None:
            return None  # a random partition: unknown before delivery
        count = self._partitions(record.topic)
        if not count:
            return None
        return (murmur2(record.key) & 0x7FFFFFFF) % count


class PartitionCounts:
    """Partition counts of topics, read from the cluster's metadata and kept a while."""

    def __init__(self, admin_config: Mapping[str, Any]) -> None:
        self._config = dict(admin_config)
        self._admin: Any = None
        self._known: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, topic: str) -> int | None:
        known = self._known.get(topic)
        if known is not None and time.monotonic() - known[1] < _PARTITIONS_TTL_S:
            return known[0]
        with self._lock:
            count = self._read(topic)
        if count is not None:
            self._known[topic] = (count, time.monotonic())
        return count

    def close(self) -> None:
        """Drop the admin client (librdkafka's handle goes with it); a later lookup
        opens another."""
        with self._lock:
            self._admin = None

    def _read(self, topic: str) -> int | None:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        try:
            if self._admin is None:
                self._admin = AdminClient(self._config)
            metadata = self._admin.list_topics(topic=topic, timeout=5).topics.get(topic)
        except KafkaException as exc:
            logger.debug("no partition count for %s: %s", topic, exc)
            return None
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return None
        return len(metadata.partitions)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (Java client's ``Utils.murmur2``, librdkafka's murmur2), as
    an unsigned 32-bit integer."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length // 4
    for word in struct.unpack_from(f"<{whole}I", data):
        k = (word * m) & 0xFFFFFFFF
        k ^= k >> 24
        h = ((h * m) & 0xFFFFFFFF) ^ ((k * m) & 0xFFFFFFFF)
    tail, rest = data[whole * 4 :], length % 4
    if rest == 3:
        h ^= tail[2] << 16
    if rest >= 2:
        h ^= tail[1] << 8
    if rest >= 1:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


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
        found = {k: v for k, v in found.items() if k not in _TRACE_HEADERS} | carrier
    return found


def _unsampled(carrier: Mapping[str, str]) -> bool:
    """Whether the row's traceparent is a version-00 one whose writer did not sample it
    (read without parsing it all: most rows of a sampled system are such rows)."""
    traceparent = carrier.get(TRACEPARENT, "")
    return len(traceparent) == 55 and traceparent[:3] == "00-" and traceparent[-1] in "02468ace"


def _trace_carrier(headers: Any) -> dict[str, str]:
    """The row's trace headers, if they are text (a row may hold anything there)."""
    if not headers or not isinstance(headers, dict):
        return {}
    return {k: v for k in _TRACE_HEADERS if isinstance(v := headers.get(k), str)}


def _with_headers(record: KafkaRecord, trace: list[tuple[str, bytes]]) -> KafkaRecord:
    headers: list[tuple[str, str | bytes | None]] = list(record.headers)
    if any(name in _TRACE_HEADERS for name, _ in headers):  # the row's: the relay's replace them
        headers = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
    headers += trace
    size = record.size
    if size >= 0:
        size += _headers_size(headers) - _headers_size(record.headers)
    return record._replace(headers=headers, size=size)


def _headers_size(headers: Sequence[tuple[str, str | bytes | None]]) -> int:
    return sum(len(k) + len(v or b"") for k, v in headers)


class TracingEncoder(RecordEncoder):
    """The relay's encoder, whose records also carry their span's context."""

    def __init__(self, inner: RecordEncoder, tracer: RelayTracer) -> None:
        # Not the base's __init__: everything but encode() is the inner encoder's.
        self._inner, self._tracer = inner, tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, event: OutboxEvent, subscriber: Subscriber) -> KafkaRecord:
        return self._tracer.start(event, self._inner.encode(event, subscriber))
