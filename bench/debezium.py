"""Debezium side by side: Debezium Server + Outbox Event Router and the relay on the same
rows, the same Postgres, the same broker, in the same run (issue #15).

Set-up
    A Postgres cluster of this benchmark's own, with ``wal_level=logical`` (Debezium
    decodes the WAL; the stack's cluster runs at the default level), fsync as the stack's;
    both sides use it. Debezium Server (relay/localstack/debezium.py): the PostgreSQL
    connector (pgoutput, a publication of the outbox table only, no snapshot, only the
    columns the router reads), the Outbox Event Router mapped onto the project's outbox
    columns (``message_id`` → the ``id`` header, ``aggregate_id`` → key, ``payload`` →
    value, ``aggregate_type`` → topic, ``event_type`` and ``aggregate_type`` → headers),
    the Kafka sink. Values: Debezium passes the jsonb payload through as its text
    (``simplestring``); the relay uses its ``json`` value format (it parses and
    re-serialises each payload). Both publish the JSON payload keyed by the aggregate id,
    to topics of 3 partitions. The relay's records are in Kafka transactions, with its
    checkpoints; Debezium Server's sink has no transactions.

Backlog throughput
    Debezium streams only what is written after its slot exists, and the router handles
    only inserts. So Debezium is started on the empty outbox, publishes one primer row
    (which makes it store an offset) and is stopped; then ``scale.events`` OrderPlaced
    rows (bench.harness.fill_outbox's, 1000 per transaction) are written. The relay
    publishes them first (a new subscriber from the beginning, in-process):
    its rate runs from its first checkpoint to its last (throughput.relay_rate). Then
    Debezium is started again and publishes the same rows from its slot: its rate runs
    from the moment a read_committed consumer has seen 5000 records (the relay's batch:
    the relay's rate leaves its first batch out too) to the last; from the first record
    is in the details (``from_first_record_ev_s``). That consumer (its own process)
    counts the relay's records too, so both sides share the host with it;
    ``consumer_ev_s`` is the relay's rate as it saw it.

Latency at 1k ev/s
    bench/latency.py's app writer and read_committed consumer (separate processes): one
    event per transaction through the write API, commit → visible. Debezium first (the
    server that just published the backlog: its JIT is warm), on the same database; then
    the relay, with production defaults but json values, on a new database of the same
    cluster.

Debezium's settings (``DEBEZIUM_TUNING``, also in every figure's details)
    * ``max.batch.size`` 8192 and ``max.queue.size`` 32768 (defaults 2048 and 8192, the
      queue 4x the batch as by default): the Kafka sink sends a batch and waits for every
      acknowledgement before it takes the next, so bigger batches amortise that wait.
    * ``poll.interval.ms`` 10 (default 500): the connector sleeps this long when the
      replication stream has nothing, and the queue waits up to this long to fill a batch.
      At 500 ms every event would wait about half a second; a user who cares about
      latency lowers it. A backlog fills every batch, so throughput does not depend on it.
    * The Kafka producer as the relay's: ``linger.ms`` 5 and ``batch.size`` 1000000
      (librdkafka's default, which the relay keeps; the Java client's 16 KiB would split
      each batch into many requests); ``acks=all`` and idempotence on both sides (the
      relay always sets them, the Java client has them by default); no compression.
    * Offsets flushed at Debezium Server's default interval (60 s): no cost per batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from bench import latency, throughput
from bench.harness import (
    BATCH,
    SPAWN,
    Figure,
    Scale,
    Stack,
    create_topics,
    fill_outbox,
    order_payload,
    reap,
    receive,
    spawn_child,
    wait_until,
)
from relay.localstack import LocalPostgres
from relay.localstack.debezium import LocalDebeziumServer, postgres_to_kafka

DEBEZIUM_TUNING = {
    "debezium.source.max.batch.size": "8192",
    "debezium.source.max.queue.size": "32768",
    "debezium.source.poll.interval.ms": "10",
    "debezium.sink.kafka.producer.linger.ms": "5",
    "debezium.sink.kafka.producer.batch.size": "1000000",
}
BACKLOG_TYPE = "order"  # fill_outbox's aggregate type
PRIMER_TYPE = "primer"  # the row that makes Debezium store an offset before the backlog
ROWS_PER_TRANSACTION = 1000  # the backlog is written by many transactions, as apps do
ROUTER_COLUMNS = ("message_id", "aggregate_type", "aggregate_id", "event_type", "payload")


def run(stack: Stack, scale: Scale) -> list[Figure]:
    with _logical_postgres(stack) as server:
        url = stack.database("debezium", server)
        prefix = stack.topic_prefix("debezium")
        debezium = LocalDebeziumServer(
            stack.workdir / f"{prefix}.server", _properties(stack, server, url, prefix)
        )
        try:
            relay_rate, debezium_rate = _backlog(stack, scale, url, debezium, prefix)
            debezium_latency = _debezium_latency(stack, scale, url, prefix)
        finally:
            debezium.stop()
        relay_latency = latency.relay_latency(
            stack, scale, stack.database("latency", server), value_format="json"
        )
    settings = {name.removeprefix("debezium."): value for name, value in DEBEZIUM_TUNING.items()}
    return [
        _throughput_figure(relay_rate, debezium_rate, scale, settings),
        *_latency_figures(relay_latency, debezium_latency, scale, settings),
    ]


@contextmanager
def _logical_postgres(stack: Stack) -> Iterator[LocalPostgres]:
    server = LocalPostgres(
        stack.workdir / "pg-logical",
        fsync=stack.postgres.fsync,
        settings={"wal_level": "logical"},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _properties(stack: Stack, server: LocalPostgres, url: str, prefix: str) -> dict[str, str]:
    """Debezium Server on the outbox of ``url``: topics ``<prefix>.<aggregate_type>``."""
    dbname = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
    router = "debezium.transforms.outbox"
    return {
        **postgres_to_kafka(server, dbname, stack.bootstrap),
        "debezium.source.table.include.list": "public.outbox",
        # Only the columns the router reads: Debezium converts no others.
        "debezium.source.column.include.list": ",".join(
            f"public.outbox.{column}" for column in ROUTER_COLUMNS
        ),
        "debezium.source.extended.headers.enabled": "false",
        "debezium.transforms": "outbox",
        f"{router}.type": "io.debezium.transforms.outbox.EventRouter",
        f"{router}.table.field.event.id": "message_id",
        f"{router}.table.field.event.key": "aggregate_id",
        f"{router}.table.field.event.payload": "payload",
        f"{router}.route.by.field": "aggregate_type",
        f"{router}.route.topic.replacement": prefix + ".${routedByValue}",
        f"{router}.table.fields.additional.placement": (
            "event_type:header:event_type,aggregate_type:header:aggregate_type"
        ),
        "debezium.format.key": "simplestring",
        "debezium.format.value": "simplestring",
        # Headers can only be JSON: the id header arrives quoted (bench/latency.py strips it).
        "debezium.format.header": "json",
        "debezium.format.header.schemas.enable": "false",
        **DEBEZIUM_TUNING,
    }


# -- backlog throughput ----------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    ev_s: float
    details: dict[str, Any]


def _backlog(
    stack: Stack, scale: Scale, url: str, debezium: LocalDebeziumServer, prefix: str
) -> tuple[Rate, Rate]:
    """The relay's rate and Debezium's on the same backlog; leaves Debezium running."""
    primer, backlog = f"{prefix}.{PRIMER_TYPE}", f"{prefix}.{BACKLOG_TYPE}"
    relay_topic = f"{stack.topic_prefix('relay')}.orders"
    create_topics(stack.bootstrap, [primer, backlog, relay_topic], latency.PARTITIONS)
    _create_slot(stack, url, debezium, primer)
    fill_outbox(url, scale.events, chunk=ROWS_PER_TRANSACTION)
    timeout = 120 + scale.events / 500
    events = scale.events + 1  # and the primer, which the relay publishes too
    with _counting(stack.bootstrap, relay_topic, events) as relay_seen:
        rate, details = throughput.relay_rate(stack, url, events, relay_topic, value_format="json")
        relay_span = relay_seen(timeout)
    with _counting(stack.bootstrap, backlog, scale.events) as debezium_seen:
        debezium.start()
        debezium_span = _published(debezium_seen, timeout, debezium)
    relay = Rate(rate, {**details, "consumer_ev_s": round(relay_span.ev_s(BATCH))})
    return relay, Rate(debezium_span.ev_s(BATCH), debezium_span.details())


def _create_slot(stack: Stack, url: str, debezium: LocalDebeziumServer, primer: str) -> None:
    """Debezium's first start creates its slot and publication; it is stopped once it
    has published a primer row (a stop stores the offset of what it published)."""
    with _counting(stack.bootstrap, primer, 1) as seen:
        debezium.start()
        debezium.wait_streaming(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES (%s, '0', 'OrderPlaced', %s)",
                (PRIMER_TYPE, json.dumps(order_payload())),
            )
        _published(seen, 120, debezium)
    debezium.stop()


def _published(
    seen: Callable[[float], Span], timeout: float, debezium: LocalDebeziumServer
) -> Span:
    """What the consumer saw Debezium publish; names Debezium Server's log if it fails."""
    try:
        return seen(timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; Debezium Server's log: {debezium.log_path}") from exc


@dataclass(frozen=True)
class Span:
    """What a counting consumer saw: (CLOCK_MONOTONIC time, records so far) after every
    batch it received."""

    points: list[tuple[float, int]]

    def ev_s(self, skip: int = 1) -> float:
        """Records per second from the batch that brought the count to ``skip`` to the
        last: with ``skip=BATCH``, the window of the relay's checkpoint-based rate."""
        start, before = next(p for p in self.points if p[1] >= skip)
        end, count = self.points[-1]
        return (count - before) / (end - start)

    def details(self) -> dict[str, Any]:
        return {
            "records": self.points[-1][1],
            "seconds": round(self.points[-1][0] - self.points[0][0], 3),
            "from_first_record_ev_s": round(self.ev_s()),
        }


@contextmanager
def _counting(bootstrap: str, topic: str, expected: int) -> Iterator[Callable[[float], Span]]:
    """A read_committed consumer process on ``topic``, assigned before the block runs;
    the block calls the yielded function (with a timeout) for its :class:`Span`."""
    ready, stop = SPAWN.Event(), SPAWN.Event()
    consumer, results = spawn_child(_count, bootstrap, topic, expected, ready, stop)
    try:
        wait_until(ready.is_set, consumer, 30.0, "the consumer to be assigned")

        def seen(timeout: float) -> Span:
            return Span(receive(results, consumer, timeout))

        yield seen
    finally:
        stop.set()
        reap(consumer)


def _count(
    bootstrap: str, topic: str, expected: int, ready: Event, stop: Event, out: Connection
) -> None:
    """Count records on every partition of ``topic`` until ``expected``; send the span."""
    consumer = latency.committed_reader(bootstrap, "debezium")
    points: list[tuple[float, int]] = []
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        count = sum(m.error() is None for m in consumer.consume(1000, 0.5))  # joins
        ready.set()
        while count < expected and not stop.is_set():
            if batch := sum(m.error() is None for m in consumer.consume(10_000, 0.05)):
                count += batch
                points.append((time.monotonic(), count))
    finally:
        consumer.close()
    if count >= expected:
        out.send(points)


# -- latency ---------------------------------------------------------------------------


def _debezium_latency(stack: Stack, scale: Scale, url: str, prefix: str) -> latency.Samples:
    """bench/latency.py's writer and consumer against the running Debezium Server."""
    routes = latency.aggregate_types(scale)
    topics = [f"{prefix}.{route}" for route in routes]
    create_topics(stack.bootstrap, topics, latency.PARTITIONS)
    stamps, _, arrivals = latency.measure(
        stack.bootstrap, topics, scale, ("outbox", [url, *routes])
    )
    # Debezium Server's sink has no transactions: events per transaction is left out.
    return latency.samples_of(stamps, arrivals, scale, per_transaction=1.0)


# -- figures ---------------------------------------------------------------------------

VALUES = "JSON payload: relay value_format=json, Debezium simplestring"


def _throughput_figure(
    relay: Rate, debezium: Rate, scale: Scale, settings: dict[str, str]
) -> Figure:
    details = {
        "events": scale.events,
        "rows_per_transaction": ROWS_PER_TRANSACTION,
        "values": VALUES,
        "relay": relay.details,
        "debezium": debezium.details,
        "debezium_settings": settings,
    }
    return Figure("debezium", "relay ev/s vs Debezium Server, backlog", relay.ev_s, "ev/s",
                  debezium.ev_s, "Debezium Server + Outbox Event Router, same rows",
                  "ratio>=2", details)  # fmt: skip


def _latency_figures(
    relay: latency.Samples, debezium: latency.Samples, scale: Scale, settings: dict[str, str]
) -> list[Figure]:
    """p50 (the target) and p99 (reported only) against Debezium's."""
    debezium_summary = latency.summary(debezium)
    del debezium_summary["events_per_transaction"]  # its sink has no transactions
    details = {
        "rate": scale.latency_rate,
        "values": VALUES,
        "relay": latency.summary(relay),
        "debezium": debezium_summary,
        "debezium_settings": settings,
    }
    return [
        Figure("debezium", f"commit to visible {name} vs Debezium Server", relay.ms(quantile),
               "ms", debezium.ms(quantile), f"Debezium Server + Outbox Event Router {name}",
               target, details)
        for name, quantile, target in (("p50", 0.5, "ratio<=0.5"), ("p99", 0.99, None))
    ]  # fmt: skip
