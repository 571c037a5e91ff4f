"""relay/observability/tracing.py on its own: the relay's span per record or per batch, the record's
trace headers,
the latency histogram, the partition as the producer picks it, the writer's helper,
the settings, and that tracing off imports no OpenTelemetry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind

from relay import trace_headers
from relay.adapters.kafka.partitioner import KeyPartitioner, murmur2
from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import KafkaRecord, OutboxEvent, PartId
from relay.core.ports import DeadLetterDecision
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon.metrics import _latency_histogram
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import dead_letter_record
from relay.engine.sessions import RelaySession
from relay.engine.worker import PartWorker
from relay.errors import ConfigError
from relay.observability.tracing import (
    BatchTracer,
    ChosenIds,
    RelayTracer,
    Tracing,
    TracingHook,
)
from tests.support import wait_until

JSON = Subscriber("s", topic="t", value_format=ValueFormat.JSON)
WRITER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
WRITER_SPAN = "00f067aa0ba902b7"
WRITER = f"00-{WRITER_TRACE}-{WRITER_SPAN}-01"


def event(headers: Any = None, n: int = 1, age: float = 0.0) -> OutboxEvent:
    return OutboxEvent(
        transaction_id=10,
        position=n,
        message_id=uuid.uuid4(),
        aggregate_type="order",
        aggregate_id=f"k{n}",
        aggregate_version=None,
        event_type="OrderPlaced",
        payload={"n": n},
        headers={} if headers is None else headers,
        occurred_at=datetime.now(UTC) - timedelta(seconds=age),
    )


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))  # as the relay's
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def traced(provider: TracerProvider, partitions: int | None = 3, ratio: float = 1.0) -> Tracing:
    return Tracing(
        RelayTracer(provider, KeyPartitioner(lambda topic: partitions), sample_ratio=ratio)
    )


def header(record: KafkaRecord, name: str) -> str | None:
    value = record.header(name)
    return value.decode() if isinstance(value, bytes) else value


def propagated(record: KafkaRecord) -> tuple[str, str, bool]:
    """(trace id, span id, sampled) of the record's traceparent."""
    _, trace_id, span_id, flags = (header(record, "traceparent") or "---").split("-")
    return trace_id, span_id, bool(int(flags or "0", 16) & 1)


def context(span: ReadableSpan) -> tuple[str, str]:
    found = span.get_span_context()
    assert found is not None
    return f"{found.trace_id:032x}", f"{found.span_id:016x}"


def test_a_records_span_is_a_child_of_the_rows_traceparent_and_its_context_is_the_records(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    tracing = traced(provider)
    row = event({"traceparent": WRITER, "tracestate": "app=1", "tenant": "t-1"}, age=0.03)
    record = tracing.wrap(RecordEncoder(None)).encode(row, JSON)
    assert exporter.get_finished_spans() == ()  # ends once committed, not before
    tracing.hook().published([row], [record], JSON)

    [span] = exporter.get_finished_spans()
    assert context(span)[0] == WRITER_TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == WRITER_SPAN
    assert span.kind is SpanKind.PRODUCER
    # The record carries the relay's span (a consumer continues from it), not the writer's.
    assert propagated(record) == (WRITER_TRACE, context(span)[1], True)
    assert header(record, "tracestate") == "app=1"
    assert header(record, "tenant") == "t-1"
    assert [k for k, _ in record.headers].count("traceparent") == 1
    assert record.size == KafkaRecord(*record[:4]).byte_size()  # the size follows the headers
    attributes = span.attributes or {}
    # OpenTelemetry's messaging conventions (v1.28 on): a Kafka producer's "send".
    assert span.name == "send t"
    assert (attributes["messaging.operation.name"], attributes["messaging.operation.type"]) == (
        "send",
        "send",
    )
    assert attributes["messaging.system"] == "kafka"
    assert attributes["messaging.message.id"] == str(row.message_id)
    assert attributes["messaging.destination.name"] == "t"
    assert attributes["messaging.destination.partition.id"] == str(
        (murmur2(b"k1") & 0x7FFFFFFF) % 3
    )
    assert 30 <= float(attributes["outbox.commit_to_visible_ms"]) < 60_000  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "headers",
    [{}, {"traceparent": "not a traceparent"}, {"traceparent": 42}, {"traceparent": None}],
    ids=["none", "malformed", "a number", "null"],
)
def test_a_row_without_a_usable_traceparent_starts_a_new_trace(
    exported: tuple[TracerProvider, InMemorySpanExporter], headers: dict[str, Any]
) -> None:
    provider, exporter = exported
    tracing = traced(provider, partitions=None)  # no partition count: no partition attribute
    row = event(headers)
    record = tracing.wrap(RecordEncoder(None)).encode(row, JSON)
    tracing.hook().published([row], [record], JSON)
    [span] = exporter.get_finished_spans()
    assert span.parent is None
    trace_id, span_id = context(span)
    assert propagated(record) == (trace_id, span_id, True)
    assert "messaging.destination.partition.id" not in (span.attributes or {})


@pytest.mark.parametrize("flags", ["00", "02"])
def test_a_trace_its_writer_did_not_sample_passes_unrecorded(
    exported: tuple[TracerProvider, InMemorySpanExporter], flags: str
) -> None:
    provider, exporter = exported
    tracing = traced(provider)
    writer = f"00-{WRITER_TRACE}-{WRITER_SPAN}-{flags}"
    row = event({"traceparent": writer, "tracestate": "a=1"})
    plain = RecordEncoder(None).encode(row, JSON)
    record = tracing.wrap(RecordEncoder(None)).encode(row, JSON)
    tracing.hook().published([row], [record], JSON)
    assert exporter.get_finished_spans() == ()
    assert record == plain  # the writer's context, as the relay without tracing sends it


def test_the_sample_ratio_applies_to_rows_without_a_traceparent_only(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    tracing = traced(provider, ratio=0.0)
    encoder = tracing.wrap(RecordEncoder(None))
    rows = [event(), event(), event({"traceparent": WRITER})]
    records = [encoder.encode(row, JSON) for row in rows]
    tracing.hook().published(rows, records, JSON)
    [span] = exporter.get_finished_spans()  # the sampled writer's event only
    assert context(span)[0] == WRITER_TRACE
    assert [r.header("traceparent") for r in records[:2]] == [None, None]


def test_spans_end_only_for_the_records_of_a_committed_batch(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """A batch read ahead and dropped (a reset meanwhile) is encoded again later: only
    the records that were committed end their spans."""
    provider, exporter = exported
    tracing = traced(provider)
    encoder = tracing.wrap(RecordEncoder(None))
    row = event({"traceparent": WRITER})
    encoder.encode(row, JSON)  # dropped
    again = encoder.encode(row, JSON)
    tracing.hook().published([row], [again], JSON)
    [span] = exporter.get_finished_spans()
    assert propagated(again)[:2] == (WRITER_TRACE, context(span)[1])


def test_the_worker_ends_a_span_per_published_event_and_counts_their_latency(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = exported
    tracing = traced(provider)
    store = InMemoryStore()
    owner = store.open_session("test", 1, timeout=60)
    store.add(JSON)
    assert store.claim("s", 0, owner)
    written = [store.append(event({"traceparent": WRITER}, n)) for n in range(1, 8)]
    kafka = InMemoryPublisher()
    worker = PartWorker(
        PartId("s", 0),
        session=RelaySession(owner, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: kafka,
        encoder=tracing.wrap(RecordEncoder(None)),
        batch_size=3,
        poll_interval=0.05,
        hook=tracing.hook(),
    )
    worker.start()
    try:
        last = written[-1].key
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what="all published")
    finally:
        worker.stop()
        worker.join(10)
    spans = {context(s)[1]: s for s in exporter.get_finished_spans()}
    published = kafka.published()
    assert len(spans) == len(published) == len(written)
    for record in published:
        span = spans[propagated(record)[1]]
        assert span.parent is not None and f"{span.parent.span_id:016x}" == WRITER_SPAN
    assert worker.hook.counts()["commit_to_visible_count"] == len(written)


def test_the_latency_histogram_counts_matching_events_from_their_commit() -> None:
    hook = TracingHook()
    other = Subscriber("o", topic="t", aggregate_types=frozenset({"payment"}))
    events = [event(age=0.02), event(age=3.0), event(age=-60.0)]  # the last: a future clock
    hook.published(events, [], JSON)
    hook.published(events, [], other)  # filtered out: not published
    counts = hook.counts()
    assert counts["commit_to_visible_count"] == 3
    assert counts["commit_to_visible_le_0.005"] == 1  # the future one counts as 0
    assert counts["commit_to_visible_le_0.025"] == 1
    assert counts["commit_to_visible_le_5.0"] == 1
    assert 3.0 <= counts["commit_to_visible_sum_us"] / 1e6 < 60
    family = _latency_histogram({PartId("s", 0): Counter(counts)})
    buckets = {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert (buckets["0.005"], buckets["0.025"], buckets["5.0"], buckets["+Inf"]) == (1, 2, 3, 3)


def test_murmur2_is_kafkas() -> None:
    """The values of Kafka's own test of Utils.murmur2 (as signed 32-bit integers)."""
    cases = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, expected in cases.items():
        assert murmur2(data) == expected & 0xFFFFFFFF, data


def test_trace_headers_writes_the_current_spans_context(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = exported
    assert trace_headers({"tenant": "t-1"}) == {"tenant": "t-1"}  # no active span
    with provider.get_tracer("app").start_as_current_span("write") as span:
        headers = trace_headers({"tenant": "t-1", "traceparent": "stale"})
    ctx = span.get_span_context()
    assert headers["tenant"] == "t-1"
    assert headers["traceparent"].split("-")[1:3] == [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"]


def test_tracing_settings_are_validated_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().tracing is False
    monkeypatch.setenv("RELAY_TRACING", "true")
    monkeypatch.setenv("RELAY_TRACING_SAMPLE_RATIO", "0.25")
    settings = load_settings(tracing_endpoint="http://collector:4318/v1/traces")
    assert (settings.tracing, settings.tracing_sample_ratio) == (True, 0.25)
    assert settings.tracing_service_name == "outbox-relay"
    for key, value in [
        ("tracing_sample_ratio", 1.5),
        ("tracing_endpoint", "collector:4318"),
        ("tracing_service_name", ""),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_settings(**{key: value})


def test_tracing_without_the_extra_installed_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("opentelemetry") else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"tracing .*outbox-relay\[tracing\]"):
        load_settings(tracing=True)


def test_with_tracing_off_the_relay_imports_no_opentelemetry() -> None:
    script = (
        "import sys\n"
        "from relay.cli import app\n"
        "from relay.daemon import Relay\n"
        "from relay.core.settings import load_settings\n"
        "relay = Relay(load_settings(database_url='postgresql://u@127.0.0.1:1/d', "
        "bootstrap_servers='127.0.0.1:1', metrics_enabled=False))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- a span per batch (tracing_spans = "batch", the default) ------------------------


@pytest.fixture
def batch_exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter, ChosenIds]]:
    exporter = InMemorySpanExporter()
    ids = ChosenIds()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON), id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter, ids
    provider.shutdown()


def batched(
    exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
    *,
    ratio: float = 1.0,
    links: int = 128,
) -> Tracing:
    provider, _, ids = exported
    tracer = BatchTracer(
        provider, ids, KeyPartitioner(lambda topic: 3), sample_ratio=ratio, max_links=links
    )
    return Tracing(batches=tracer)


def writer(n: int, flags: str = "01") -> str:
    return f"00-{WRITER_TRACE[:-2]}{n:02x}-{WRITER_SPAN[:-2]}{n:02x}-{flags}"


def test_a_batch_has_one_span_linking_each_writer_and_its_records_carry_it(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    _, exporter, _ = batch_exported
    tracing = batched(batch_exported)
    rows = [event({"traceparent": writer(n), "tracestate": "a=1"}, n, age=0.03) for n in (1, 2, 3)]
    hook = tracing.hook()
    records = hook.sending([RecordEncoder(None).encode(row, JSON) for row in rows])
    assert exporter.get_finished_spans() == ()  # made once committed
    hook.published(rows, records, JSON)

    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.kind is SpanKind.PRODUCER
    trace_id, span_id = context(span)
    for record in records:  # a consumer continues from the batch's span
        assert propagated(record) == (trace_id, span_id, True)
        assert record.header("tracestate") is None  # the writer's went with its traceparent
        assert record.size == KafkaRecord(*record[:4]).byte_size()
    linked = {
        (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}"): link
        for link in span.links
    }
    for row in rows:  # ... which links back to each writer's, naming the event
        _, wtrace, wspan, _ = (row.headers or {})["traceparent"].split("-")
        attributes = linked[(wtrace, wspan)].attributes or {}
        assert attributes["messaging.message.id"] == str(row.message_id)
    attributes = span.attributes or {}
    assert span.name == "send t"
    assert (attributes["messaging.operation.name"], attributes["messaging.operation.type"]) == (
        "send",
        "send",
    )
    assert attributes["messaging.batch.message_count"] == 3
    assert attributes["messaging.destination.name"] == "t"
    assert list(attributes["outbox.partitions"]) == sorted(  # type: ignore[arg-type]
        {(murmur2(b"k%d" % n) & 0x7FFFFFFF) % 3 for n in (1, 2, 3)}
    )
    assert 30 <= float(attributes["outbox.commit_to_visible_ms.max"]) < 60_000  # type: ignore[arg-type]


def test_a_batch_leaves_untraced_records_as_they_are(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    """A writer that did not sample, a dead letter, a row without a traceparent when the
    ratio says no: as the relay without tracing sends them, and no span at all."""
    _, exporter, _ = batch_exported
    tracing = batched(batch_exported, ratio=0.0)
    unsampled, plain = event({"traceparent": writer(1, "00")}), event()
    poison = event({"traceparent": writer(2)})
    letter = dead_letter_record(poison, JSON, DeadLetterDecision("dlq", "bad", False))
    records = [RecordEncoder(None).encode(unsampled, JSON), RecordEncoder(None).encode(plain, JSON)]
    hook = tracing.hook()
    sent = hook.sending([*records, letter])
    hook.published([unsampled, plain, poison], sent, JSON)
    assert sent == [*records, letter]
    assert exporter.get_finished_spans() == ()


def test_a_batch_traces_at_most_its_links_and_the_rest_keep_their_writers_context(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    _, exporter, _ = batch_exported
    tracing = batched(batch_exported, links=2)
    rows = [event({"traceparent": writer(n)}, n) for n in (1, 2, 3, 4)]
    hook = tracing.hook()
    records = hook.sending([RecordEncoder(None).encode(row, JSON) for row in rows[:3]])
    # What joins the transaction in flight joins the batch (and its limit).
    records += hook.joining([RecordEncoder(None).encode(rows[3], JSON)])
    hook.published(rows, records, JSON)
    [span] = exporter.get_finished_spans()
    assert len(span.links) == 2
    assert [propagated(r)[1] for r in records[:2]] == [context(span)[1]] * 2
    assert [header(r, "traceparent") for r in records[2:]] == [writer(3), writer(4)]
    attributes = span.attributes or {}
    assert (attributes["messaging.batch.message_count"], attributes["outbox.traced_count"]) == (
        4,
        2,
    )


def test_a_batch_sent_again_is_one_span_the_committed_one(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    _, exporter, _ = batch_exported
    tracing = batched(batch_exported)
    row = event({"traceparent": writer(1)})
    hook = tracing.hook()
    record = RecordEncoder(None).encode(row, JSON)
    hook.sending([record])  # refused by the broker, say: sent again
    again = hook.sending([record])
    hook.published([row], again, JSON)
    [span] = exporter.get_finished_spans()
    assert propagated(again[0])[1] == context(span)[1]


def test_the_worker_makes_a_span_per_published_batch_linking_every_event(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    _, exporter, _ = batch_exported
    tracing = batched(batch_exported)
    store = InMemoryStore()
    owner = store.open_session("test", 1, timeout=60)
    store.add(JSON)
    assert store.claim("s", 0, owner)
    written = [store.append(event({"traceparent": writer(n)}, n)) for n in range(1, 8)]
    kafka = InMemoryPublisher()
    worker = PartWorker(
        PartId("s", 0),
        session=RelaySession(owner, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: kafka,
        encoder=tracing.wrap(RecordEncoder(None)),
        batch_size=3,
        poll_interval=0.05,
        hook=tracing.hook(),
    )
    worker.start()
    try:
        last = written[-1].key
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what="all published")
    finally:
        worker.stop()
        worker.join(10)
    spans = {context(s)[1]: s for s in exporter.get_finished_spans()}
    assert 3 <= len(spans) < len(written)  # batches of 3 (or more: what joined them)
    links = {}
    for span in spans.values():
        for link in span.links:
            links[str((link.attributes or {})["messaging.message.id"])] = span
    published = kafka.published()
    assert len(published) == len(links) == len(written)
    for record in published:  # each record carries the span that links its writer
        assert links[str(record.outbox_message_id)] is spans[propagated(record)[1]]
    assert worker.hook.counts()["commit_to_visible_count"] == len(written)


def test_the_span_mode_is_a_setting() -> None:
    assert load_settings().tracing_spans == "batch"
    assert load_settings(tracing_spans="event").tracing_spans == "event"
    with pytest.raises(ConfigError, match="tracing_spans"):
        load_settings(tracing_spans="row")
    with pytest.raises(ConfigError, match="tracing_batch_links"):
        load_settings(tracing_batch_links=0)


def test_a_batch_to_several_topics_is_named_for_its_operation_alone(
    batch_exported: tuple[TracerProvider, InMemorySpanExporter, ChosenIds],
) -> None:
    """The conventions' destination is one name: a batch of a routed subscriber that
    wrote to two topics names none, and lists them in ``outbox.destinations``."""
    _, exporter, _ = batch_exported
    hook = batched(batch_exported).hook()
    rows = [event({"traceparent": writer(n)}, n) for n in (1, 2)]
    records = [RecordEncoder(None).encode(row, JSON) for row in rows]
    records[1] = records[1]._replace(topic="u")
    hook.published(rows, hook.sending(records), JSON)
    [span] = exporter.get_finished_spans()
    attributes = span.attributes or {}
    assert span.name == "send"
    assert "messaging.destination.name" not in attributes
    assert list(attributes["outbox.destinations"]) == ["t", "u"]  # type: ignore[arg-type]


def test_a_batch_encoded_whole_carries_a_span_per_record(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # The worker encodes an unfiltered subscriber's batch in one call: the traced
    # encoder must start each record's span there too, not hand over the inner one's.
    provider, exporter = exported
    tracing = traced(provider)
    rows = [event({"traceparent": WRITER}), event({})]
    records = tracing.wrap(RecordEncoder(None)).for_batches(JSON)(rows)
    tracing.hook().published(rows, records, JSON)
    spans = exporter.get_finished_spans()
    assert sorted(propagated(r)[1] for r in records) == sorted(context(s)[1] for s in spans)
    assert len(spans) == 2
