"""Trace continuity (OpenTelemetry) and the commit→visible latency of published events.

Two ways to trace, ``tracing_spans``:

- ``"batch"`` (the default): one PRODUCER span per published batch (one Kafka
  transaction), with a span link per traced event to the writer's span (the row's W3C
  ``traceparent``), the link carrying the event id. Every traced record's
  ``traceparent`` is the batch span's, so a consumer continues from the batch span,
  which links back to the writer's (:class:`BatchTracer`). A span costs tens of
  microseconds in the Python SDK; a link a few: per-event spans cost most of the
  relay's throughput (docs/tracing.md, "Cost").
- ``"event"``: as follows.

With ``tracing_spans = "event"`` every record the relay publishes gets a PRODUCER span of its own,
a child of the W3C ``traceparent`` the row's headers carry (the writer's span: see
:func:`relay.trace_headers`), or a new trace's root when the row has none. The record's
``traceparent``/``tracestate`` headers are replaced by the new span's, so a consumer
continues the trace from the relay's span. The span starts when the record is encoded
and ends once its batch is committed in Kafka (visible to ``read_committed`` consumers);
it carries the event id, topic, partition and the commit→visible latency. Spans go out
over OTLP/HTTP in a background thread (the SDK's batch processor).

OpenTelemetry is imported only when tracing is on: with it off, the relay pays for the
latency histogram alone (:class:`TracingHook`, :mod:`relay.observability.latency`), one
bucket increment per event.

The partition a keyed record goes to is asked of a :data:`PartitionOf` the relay's
wiring hands in (Kafka's partitioner: ``relay.adapters.kafka.partitioner``): this module
speaks OpenTelemetry only, never Kafka.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from relay.core.model import (
    HEADER_ID,
    TRACE_HEADERS,
    TRACEPARENT,
    TRACESTATE,
    KafkaRecord,
    OutboxEvent,
)
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import HEADER_ERROR
from relay.observability.latency import CommitLatency, ages_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

    from relay.core.settings import Settings
    from relay.core.subscribers import Subscriber

logger = logging.getLogger(__name__)

# The partition Kafka's producer picks for a keyed record of a topic, None when it is
# not known (yet).
PartitionOf = Callable[[str, bytes], "int | None"]

# OpenTelemetry's messaging span conventions (semantic conventions v1.28 and later, where
# the operation type `publish` became `send`): a Kafka producer's spans are named
# `send <topic>`, and carry the operation's name and type, both `send` for Kafka.
SEND = "send"
_SEND_ATTRIBUTES = {
    "messaging.system": "kafka",
    "messaging.operation.name": SEND,
    "messaging.operation.type": SEND,
}

# Spans started for records that were never committed (a batch read ahead then dropped,
# a batch failed and read again after recovery) are forgotten, oldest first, beyond this
# many: they are simply not exported. Bounds the memory they hold (a span is about 1 KB)
# while leaving room for ten full batches in flight.
_MAX_PENDING = 50_000
# At stop: how long the last spans may take to leave (a collector that is down must not
# hold the relay's shutdown).
_FLUSH_TIMEOUT_MS = 5000


class TracingHook:
    """The relay's :class:`~relay.core.publish_hook.PublishHook`, told by a part's worker
    of each batch it sends and of each it committed. Without tracing it records the
    latency histogram only; with it, it also ends the batch's spans (per event), or opens
    the batch's span and puts its context in the records (per batch). One per worker: a
    worker sends one batch at a time."""

    def __init__(
        self, tracer: RelayTracer | None = None, batches: BatchTracer | None = None
    ) -> None:
        self.latency = CommitLatency()
        self._tracer = tracer
        self._batches = batches
        self._sending: _SentBatch | None = None  # the batch in flight, per batch

    def sending(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records``, about to be sent in one transaction, as they are to be sent."""
        if self._batches is None:
            return records
        self._sending = self._batches.open()  # a batch sent again is a new span
        return self._batches.stamp(self._sending, records)

    def joining(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records`` joining the transaction in flight, as they are to be sent."""
        if self._batches is None or self._sending is None:
            return records
        return self._batches.stamp(self._sending, records)

    def published(
        self, events: Sequence[OutboxEvent], records: Sequence[KafkaRecord], subscriber: Subscriber
    ) -> None:
        """``records`` of ``events`` are committed (visible) now."""
        now = time.time()
        if subscriber.filtered:
            events = [e for e in events if subscriber.matches(e)]
        ages = ages_of(events, datetime.fromtimestamp(now, UTC))
        self.latency.observe(ages)
        if self._tracer is not None:
            self._tracer.finish(records, now)
        if self._batches is not None and self._sending is not None:
            self._batches.finish(self._sending, now, ages)
            self._sending = None

    def counts(self) -> dict[str, int]:
        return self.latency.counts()


class Tracing:
    """What the relay process holds: the tracer (None: tracing off) and its provider."""

    def __init__(
        self, tracer: RelayTracer | None = None, batches: BatchTracer | None = None
    ) -> None:
        self.tracer = tracer  # per event
        self.batches = batches  # per batch

    @classmethod
    def start(cls, settings: Settings, partition_of: PartitionOf) -> Tracing:
        """``partition_of``: where a keyed record goes (the relay's wiring closes it)."""
        if not settings.tracing:
            return cls()
        if settings.tracing_spans == "batch":
            return cls(batches=BatchTracer.from_settings(settings, partition_of))
        return cls(RelayTracer.from_settings(settings, partition_of))

    def wrap(self, encoder: RecordEncoder) -> RecordEncoder:
        """``encoder``, or with tracing on, one that also starts each record's span."""
        if self.tracer is None:
            return encoder
        return TracingEncoder(encoder, self.tracer)

    def hook(self) -> TracingHook:
        """A new part worker's hook."""
        return TracingHook(self.tracer, self.batches)

    def flush(self) -> None:
        """Export the spans ended so far (at stop)."""
        if self.tracer is not None:
            self.tracer.flush()
        if self.batches is not None:
            self.batches.flush()


class RelayTracer:
    """Starts a span per record as it is encoded, and ends it once committed."""

    def __init__(
        self,
        provider: TracerProvider,
        partition_of: PartitionOf,
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
        self._partition_of = partition_of
        # traceparent header written -> (its span, the event's commit time in seconds)
        self._pending: dict[bytes, tuple[Span, float]] = {}

    @classmethod
    def from_settings(cls, settings: Settings, partition_of: PartitionOf) -> RelayTracer:
        provider = _provider(settings)
        return cls(provider, partition_of, sample_ratio=settings.tracing_sample_ratio)

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
            f"{SEND} {record.topic}",
            context=parent,
            kind=self._producer,
            attributes={
                **_SEND_ATTRIBUTES,
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
        return self._partition_of(record.topic, record.key)


def _provider(settings: Settings, ids: Any = None) -> TracerProvider:
    """The tracer provider: OTLP/HTTP from the SDK's batch processor (a background
    thread), every span asked for recorded (the relay samples before asking)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.tracing_service_name}),
        sampler=ParentBased(ALWAYS_ON),
        id_generator=ids,
        # A batch span keeps every link it is given (tracing_batch_links bounds them).
        span_limits=SpanLimits(max_links=max(settings.tracing_batch_links, 1)),
    )
    # None: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else http://localhost:4318/v1/traces.
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.tracing_endpoint))
    )
    return provider


class _SentBatch:
    """A batch in flight: the ids its span will have, and the events it traces."""

    __slots__ = (
        "chosen", "headers", "keys", "links", "records", "span_id", "started_ns", "trace_id",
    )  # fmt: skip

    def __init__(self, trace_id: int, span_id: int) -> None:
        self.trace_id, self.span_id = trace_id, span_id
        self.started_ns = time.time_ns()
        traceparent = f"00-{trace_id:032x}-{span_id:016x}-01".encode()
        self.headers = [(TRACEPARENT, traceparent)]
        # (trace id, span id, flags, message id) of each traced event's writer; a row
        # without a traceparent has trace id 0 (no writer to link).
        self.links: list[tuple[int, int, int, bytes]] = []
        self.keys: dict[str, set[bytes]] = {}  # topic -> keys of the traced records
        self.chosen: set[int] = set()  # partitions the subscriber chose (partition_by)
        self.records = 0  # sent in the batch, traced or not


class BatchTracer:
    """One span per published batch: its context goes into the traced records' headers
    when the batch is sent; the span is made once the batch is committed (a batch
    never committed costs no span), with the ids and start time it had when sent, and
    a link per traced event to its writer's span.

    At most ``max_links`` events of a batch are traced: a span link costs about 10 µs
    (made, kept and encoded by the SDK), so a backlog's batches of thousands would
    cost most of the relay's throughput. The events beyond keep their writer's
    ``traceparent``: a consumer still continues the writer's trace, without the
    relay's hop, and the span counts them (``messaging.batch.message_count``). A
    caught-up relay's batches are small: every event is traced."""

    def __init__(
        self,
        provider: TracerProvider,
        ids: ChosenIds,
        partition_of: PartitionOf,
        *,
        sample_ratio: float = 1.0,
        max_links: int = 128,
    ) -> None:
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

        self._root = Context()
        self._link, self._context, self._flags = Link, SpanContext, TraceFlags
        self._producer = SpanKind.PRODUCER
        self._provider = provider
        self._tracer: Tracer = provider.get_tracer("outbox-relay")
        self._ids = ids
        self._partition_of = partition_of
        self._sample_ratio = sample_ratio
        self._max_links = max_links

    @classmethod
    def from_settings(cls, settings: Settings, partition_of: PartitionOf) -> BatchTracer:
        ids = ChosenIds()
        provider = _provider(settings, ids)
        return cls(
            provider,
            ids,
            partition_of,
            sample_ratio=settings.tracing_sample_ratio,
            max_links=settings.tracing_batch_links,
        )

    def open(self) -> _SentBatch:
        return _SentBatch(random.getrandbits(128) or 1, random.getrandbits(64) or 1)

    def stamp(self, batch: _SentBatch, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records`` with the batch span's context in place of the row's for each
        traced event. Parent-based as per event: a row whose writer did not sample its
        trace passes as it is; a row without a traceparent is traced at
        ``sample_ratio``. Dead letters pass as they are; so does every record once the
        batch traces ``max_links`` events."""
        batch.records += len(records)
        room = self._max_links - len(batch.links)
        if room <= 0:
            return records
        stamped: list[KafkaRecord] = []
        for at, record in enumerate(records):
            written = _traced(record)
            if written is None:
                stamped.append(record)
                continue
            if written:
                trace_id, span_id, flags = written
            elif self._sample_ratio < 1.0 and random.random() >= self._sample_ratio:
                stamped.append(record)
                continue
            else:
                trace_id = span_id = flags = 0
            message_id = record.header(HEADER_ID)
            message = message_id if isinstance(message_id, bytes) else b""
            batch.links.append((trace_id, span_id, flags, message))
            keys = batch.keys.setdefault(record.topic, set())
            if record.partition is not None:
                batch.chosen.add(record.partition)
            elif record.key is not None:
                keys.add(record.key)
            stamped.append(_with_headers(record, batch.headers))
            room -= 1
            if not room:
                stamped += records[at + 1 :]
                break
        return stamped

    def finish(self, batch: _SentBatch, now: float, ages_us: Sequence[int]) -> None:
        """Make ``batch``'s span, committed at ``now``; ``ages_us``: commit→visible of its
        events, in microseconds."""
        if not batch.links:
            return  # nothing traced: no span
        topics = sorted(batch.keys)
        written = self._written(batch)
        attributes: dict[str, Any] = {
            **_SEND_ATTRIBUTES,
            # One destination is named; several are not (the conventions' name is a
            # string): the span is then named for its operation alone, its topics listed.
            **(
                {"messaging.destination.name": topics[0]}
                if len(topics) == 1
                else {"outbox.destinations": topics}
            ),
            "messaging.batch.message_count": batch.records,
            "outbox.traced_count": len(batch.links),
            "outbox.partitions": written,
        }
        if len(written) == 1:
            attributes["messaging.destination.partition.id"] = str(written[0])
        if ages_us:
            attributes["outbox.commit_to_visible_ms.max"] = max(ages_us) / 1e3
            attributes["outbox.commit_to_visible_ms.min"] = min(ages_us) / 1e3
        name = f"{SEND} {topics[0]}" if len(topics) == 1 else SEND
        self._ids.choose(batch.trace_id, batch.span_id)
        try:
            span = self._tracer.start_span(
                name,
                context=self._root,
                kind=self._producer,
                attributes=attributes,
                links=self._links(batch),
                start_time=batch.started_ns,
            )
        finally:
            self._ids.choose(None)
        span.end(end_time=int(now * 1e9))

    def flush(self) -> None:
        self._provider.force_flush(_FLUSH_TIMEOUT_MS)

    def _links(self, batch: _SentBatch) -> list[Link]:
        link, context, flags = self._link, self._context, self._flags
        return [
            link(
                context(trace_id, span_id, True, flags(sampled)),
                {"messaging.message.id": message.decode(errors="replace")},
            )
            for trace_id, span_id, sampled, message in batch.links
            if trace_id
        ]

    def _written(self, batch: _SentBatch) -> list[int]:
        """The partitions the traced records went to, as the producer picks them."""
        found = set(batch.chosen)
        for topic, keys in batch.keys.items():
            for key in keys:
                partition = self._partition_of(topic, key)
                if partition is None:
                    break  # the topic's partition count is unknown: so for every key
                found.add(partition)
        return sorted(found)


class ChosenIds:
    """The SDK's id generator, except that the ids of the span being made now can be
    chosen (per thread): a batch span's ids are in its records before the span exists."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._chosen = threading.local()

    def choose(self, trace_id: int | None, span_id: int | None = None) -> None:
        """The ids of the next span this thread makes (None: random again)."""
        self._chosen.ids = None if trace_id is None else (trace_id, span_id)

    def generate_span_id(self) -> int:
        ids = getattr(self._chosen, "ids", None)
        return self._random.generate_span_id() if ids is None else int(ids[1])

    def generate_trace_id(self) -> int:
        ids = getattr(self._chosen, "ids", None)
        return self._random.generate_trace_id() if ids is None else int(ids[0])

    def is_trace_id_random(self) -> bool:
        return True


def _traced(record: KafkaRecord) -> tuple[int, int, int] | tuple[()] | None:
    """The writer's (trace id, span id, flags) from ``record``'s traceparent; ``()``
    when it has none to link (none, or not a valid one); None when the record is not
    traced: a dead letter, or a writer's trace it did not sample."""
    traceparent: str | bytes | None = None
    for name, value in record.headers:
        if name == TRACEPARENT:
            traceparent = value
        elif name == HEADER_ERROR:
            return None
    if traceparent is None:
        return ()
    text = traceparent.decode("ascii", "replace") if isinstance(traceparent, bytes) else traceparent
    if len(text) != 55 or text[:3] != "00-" or text[35] != "-" or text[52] != "-":
        return ()
    try:
        trace_id, span_id, flags = int(text[3:35], 16), int(text[36:52], 16), int(text[53:], 16)
    except ValueError:
        return ()
    if not flags & 1:
        return None  # the writer did not sample it: it passes as it is
    if not trace_id or not span_id:
        return ()
    return trace_id, span_id, flags


def _unsampled(carrier: Mapping[str, str]) -> bool:
    """Whether the row's traceparent is a version-00 one whose writer did not sample it
    (read without parsing it all: most rows of a sampled system are such rows)."""
    traceparent = carrier.get(TRACEPARENT, "")
    return len(traceparent) == 55 and traceparent[:3] == "00-" and traceparent[-1] in "02468ace"


def _trace_carrier(headers: Any) -> dict[str, str]:
    """The row's trace headers, if they are text (a row may hold anything there)."""
    if not headers or not isinstance(headers, dict):
        return {}
    return {k: v for k in TRACE_HEADERS if isinstance(v := headers.get(k), str)}


def _with_headers(record: KafkaRecord, trace: list[tuple[str, bytes]]) -> KafkaRecord:
    """``record`` with ``trace`` in place of its trace headers (the row's: the relay's
    replace them); its size follows (computed from what changed: this runs per event)."""
    headers: list[tuple[str, str | bytes | None]] = []
    size = record.size
    for header in record.headers:
        if header[0] in TRACE_HEADERS:
            size -= len(header[0]) + len(header[1] or b"")
        else:
            headers.append(header)
    headers += trace
    if record.size >= 0:
        size += _headers_size(trace)
    else:
        size = record.size
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

    def for_subscriber(self, subscriber: Subscriber) -> Callable[[OutboxEvent], KafkaRecord]:
        encode, start = self._inner.for_subscriber(subscriber), self._tracer.start
        return lambda event: start(event, encode(event))

    def for_batches(
        self, subscriber: Subscriber
    ) -> Callable[[list[OutboxEvent]], list[KafkaRecord]]:
        # Defined here, not left to __getattr__: the inner encoder's records carry no span.
        encode_all, start = self._inner.for_batches(subscriber), self._tracer.start
        return lambda events: list(map(start, events, encode_all(events)))
