"""Debezium side by side: Debezium Server + Outbox Event Router and the relay on the same
rows, the same Postgres, the same broker, in the same run, by one instrument (#15, #31).

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
    to topics of 3 partitions. Debezium Server's sink has no transactions: it delivers
    at least once. The relay runs in both its modes, and every figure names its mode:
    ``transactional`` (exactly once: a Kafka transaction per batch, with its checkpoint)
    and ``idempotent`` (at least once across restarts, as Debezium).

The JVM (``jvm_options``)
    ``-Xms1g -Xmx1g`` (a heap that never resizes) and the GC logged to a file per start
    (``-Xlog:gc*``); the pauses of each run are in the details.

One instrument for both sides
    A read_committed consumer process (:func:`_count`) on the side's own topic, assigned
    before the side starts, notes (time, records so far) after every batch it receives
    and tallies every record's ``id`` header (:class:`Tally`): the count and a sum of the
    ids. A round whose tally differs from that of the rows written (a record lost, or
    one twice) fails: no figure comes from a run that did not deliver every record
    exactly once.

Backlog throughput, warm
    Debezium streams only what is written after its slot exists, and the router handles
    only inserts. Its slot is made once (it starts on the empty outbox, publishes a
    primer row, stops). Then every round, ``scale.repetitions`` of them, interleaved:

    1. The outbox is emptied (TRUNCATE: Debezium skips truncates) and
       ``scale.debezium_warmup + scale.debezium_events`` OrderPlaced rows are written
       (bench.harness.fill_outbox's, 1000 per transaction, as apps write), then a
       CHECKPOINT and a pause.
    2. Debezium is started and publishes them from its slot; then it is stopped.
    3. The relay publishes the same rows (a new subscriber from the beginning, one
       ``outbox-relay run`` process), exactly-once; then again, idempotent; then
       exactly-once as a 2-core deployment runs it: ``workers=2`` and a subscriber of 2
       parts, paused until they have spread one per member.

    The first side to run in a round writes its rows (rounds alternate in direction).
    ``OUTBOX_BENCH_DEBEZIUM_SIDES`` (:func:`chosen_sides`) runs a subset of the sides.

    Each side's rate runs from the batch that brought its consumer's count to the
    warm-up backlog to the last record: the first ``debezium_warmup`` records (300k by
    default) are the warm-up, in which Debezium's JVM compiles its hot code and the
    relay starts, and ``debezium_events`` (1M) are measured. CPU per process (the relay,
    the Debezium JVM, Postgres, the broker) is read over that same window.

Latency at 1k ev/s
    Debezium is restarted with its latency settings (``linger.ms=0``, ``poll.interval.ms``
    1) and drains a warm-up backlog; it then stays up, its JIT warm, but is suspended
    (SIGSTOP) through every other side's run, warm-ups included (:func:`_suspended`): its
    idle JVM polls every millisecond and took 0.4 of a core while the relay ran, which
    the relay's rounds paid for and its own did not. Each round runs
    bench/latency.py's app writer and read_committed consumer (separate processes, one
    event per transaction through the write API, commit → visible) against Debezium,
    the relay idempotent and the relay exactly-once (in-process, production defaults
    but json values, each on a new database of the same cluster).

Debezium's settings (``THROUGHPUT_TUNING``, ``LATENCY_TUNING``; in every figure's details)
    * ``max.batch.size`` 4096 and ``max.queue.size`` 16384 (defaults 2048 and 8192, the
      queue 4x the batch as by default): the Kafka sink sends a batch and waits for every
      acknowledgement before it takes the next, so bigger batches amortise that wait.
    * ``poll.interval.ms`` 5 for the backlog, 1 for latency (default 500): the connector
      sleeps this long when the replication stream has nothing, and the queue waits up to
      this long to fill a batch.
    * The Kafka producer: ``linger.ms`` 5 for the backlog (the exactly-once relay's;
      the idempotent relay's is 0), 0 for latency;
      ``batch.size`` 1000000 (librdkafka's default, which the relay keeps; the Java
      client's 16 KiB would split each batch into many requests); ``acks=all`` and
      idempotence on both sides; no compression.
    * Offsets flushed at Debezium Server's default interval (60 s) and on stop.

Kafka Connect's exactly-once source support (KIP-618), the like-for-like peer
    Debezium Server's sink delivers at least once; Kafka Connect with
    ``exactly.once.source.support=enabled`` commits each poll's records with their source
    offsets in one Kafka transaction. bench/connect.py runs a distributed worker with
    Debezium's PostgreSQL connector (the same source and router settings, a slot of its
    own, ``transaction.boundary=poll``) as a fourth side of every backlog round, timed by
    the same consumer. If the worker cannot start or the connector fails, the figure's
    details say why (``kafka_connect_exactly_once``) and the other figures stand.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import TopicPartition

from bench import latency
from bench.connect import LocalConnectWorker, connector_config, new_worker
from bench.harness import (
    SPAWN,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    create_topics,
    fill_outbox,
    fresh_subscribers,
    order_payload,
    reap,
    receive,
    spawn_child,
    wait_until,
)
from bench.method import CpuMeter, Samples, interleave, settle
from bench.sharding import set_paused, wait_spread
from relay.artifacts.maven import ArtifactFetchError
from relay.core.subscribers import Subscriber, ValueFormat
from relay.localstack import LocalPostgres
from relay.localstack.debezium import LocalDebeziumServer, postgres_to_kafka
from relay.localstack.process import LocalServerError

THROUGHPUT_TUNING = {
    "debezium.source.max.batch.size": "4096",
    "debezium.source.max.queue.size": "16384",
    "debezium.source.poll.interval.ms": "5",
    "debezium.sink.kafka.producer.linger.ms": "5",
    "debezium.sink.kafka.producer.batch.size": "1000000",
}
LATENCY_TUNING = {
    **THROUGHPUT_TUNING,
    "debezium.source.poll.interval.ms": "1",
    "debezium.sink.kafka.producer.linger.ms": "0",
}
logger = logging.getLogger(__name__)
HEAP = "1g"
BACKLOG_TYPE = "order"  # fill_outbox's aggregate type
PRIMER_TYPE = "primer"  # the row that makes Debezium store an offset before the backlog
ROWS_PER_TRANSACTION = 1000  # the backlog is written by many transactions, as apps do
ROUTER_COLUMNS = ("message_id", "aggregate_type", "aggregate_id", "event_type", "payload")
ROUTER_TOPIC = "debezium.transforms.outbox.route.topic.replacement"
EXTRA_S = 1.0  # after the last expected record, how long a consumer waits for more
RESUMED_S = 2.0  # after Debezium Server resumes, for the timers that fell due meanwhile
DEBEZIUM = "Debezium Server, at-least-once"
EXACTLY_ONCE = "relay, exactly-once (transactional)"
IDEMPOTENT = "relay, at-least-once (idempotent)"
CONNECT = "Kafka Connect + Debezium, exactly-once (KIP-618)"
MODES = {EXACTLY_ONCE: "transactional", IDEMPOTENT: "idempotent"}
# The broker's floors (bench/latency.py), measured in the same latency run: what any
# relay's mode, and Debezium, add their own work to.
FLOOR_IDEMPOTENT = "floor, idempotent producer"
FLOOR_TRANSACTIONAL = "floor, pipelined transactional producer"
FLOORS = {FLOOR_IDEMPOTENT: "idempotent", FLOOR_TRANSACTIONAL: "transactional"}
# Each relay mode's floor.
MODE_FLOORS = {IDEMPOTENT: FLOOR_IDEMPOTENT, EXACTLY_ONCE: FLOOR_TRANSACTIONAL}
# The relay as a 2-core deployment runs it (deploy/README.md): one member process per
# core, and a subscriber of as many key-hashed parts, one on each member.
WORKERS = 2
WORKER_PARTS = 2
WORKERS_EXACTLY_ONCE = f"relay, exactly-once, {WORKERS} workers x {WORKER_PARTS} parts"
SIDES_ENV = "OUTBOX_BENCH_DEBEZIUM_SIDES"
# What SIDES_ENV may name; Debezium Server always runs (its round writes the rows).
SIDE_KEYS = {
    "debezium": DEBEZIUM,
    "connect": CONNECT,
    "exactly-once": EXACTLY_ONCE,
    "idempotent": IDEMPOTENT,
    "workers": WORKERS_EXACTLY_ONCE,
    "latency": "latency",
}


@dataclass(frozen=True)
class RelaySide:
    """How a relay side runs: its delivery mode, member processes and the parts of its
    subscriber."""

    delivery: str
    workers: int = 1
    parts: int = 1


RELAY_SIDES = {
    EXACTLY_ONCE: RelaySide("transactional"),
    IDEMPOTENT: RelaySide("idempotent"),
    WORKERS_EXACTLY_ONCE: RelaySide("transactional", WORKERS, WORKER_PARTS),
}


def chosen_sides(value: str | None) -> frozenset[str]:
    """The sides ``OUTBOX_BENCH_DEBEZIUM_SIDES`` names (comma-separated keys of
    ``SIDE_KEYS``), Debezium Server's always among them; every side when unset, so a
    long run can be cut to the sides a change is about."""
    keys = {key.strip() for key in (value or "").split(",") if key.strip()}
    if not keys:
        return frozenset(SIDE_KEYS.values())
    unknown = sorted(keys - SIDE_KEYS.keys())
    if unknown:
        raise ValueError(f"{SIDES_ENV}: unknown {unknown}; choose from {sorted(SIDE_KEYS)}")
    return frozenset({DEBEZIUM, *(SIDE_KEYS[key] for key in keys)})


def run(stack: Stack, scale: Scale) -> list[Figure]:
    chosen = chosen_sides(os.environ.get(SIDES_ENV))
    with _logical_postgres(stack) as server:
        url = stack.database("debezium", server)
        prefix = stack.topic_prefix("debezium")
        properties = _properties(stack, server, url, prefix)
        debezium = LocalDebeziumServer(stack.workdir / f"{prefix}.server", properties)
        # Set up first: its primer row must reach no slot but its own.
        connect = (
            _ConnectPeer.start(stack, url, properties)
            if CONNECT in chosen
            else _ConnectPeer(None, why_not=f"not chosen ({SIDES_ENV})")
        )
        try:
            _create_slot(stack, url, debezium, prefix)
            backlog = _Backlog(stack, scale, server, url, debezium, connect)
            sides = {DEBEZIUM: backlog.debezium}
            if connect.worker is not None:
                sides[CONNECT] = backlog.connect
            relays = {side: backlog.relay(side) for side in RELAY_SIDES if side in chosen}
            rates = interleave({**sides, **relays}, scale.repetitions)
            connect.stop()
            throughput = _throughput_figures(rates, backlog.rounds, scale, connect.why_not)
            if "latency" not in chosen:
                return throughput
            try:
                latencies = _latency_rounds(stack, scale, server, url, debezium)
            except Exception:
                # The backlog's figures stand without it; the log says what failed.
                logger.exception("the latency comparison failed", extra={"event": "bench.failed"})
                return throughput
        finally:
            debezium.stop()
            connect.stop()
    return [*throughput, *_latency_figures(latencies, scale)]


@dataclass
class _ConnectPeer:
    """A Kafka Connect worker with exactly-once source support running Debezium's
    connector (bench/connect.py), its connector stopped between rounds; ``worker`` is
    None, and ``why_not`` says why, when it cannot run here."""

    worker: LocalConnectWorker | None
    topic: str = ""
    why_not: str | None = None

    @classmethod
    def start(cls, stack: Stack, url: str, server_properties: dict[str, str]) -> _ConnectPeer:
        dbname = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
        prefix = stack.topic_prefix("connect")
        properties = {
            **server_properties,
            "debezium.source.slot.name": f"dbzc_{dbname}",
            "debezium.source.publication.name": f"dbzc_{dbname}",
            ROUTER_TOPIC: prefix + ".${routedByValue}",
        }
        topics = [f"{prefix}.{BACKLOG_TYPE}", f"{prefix}.{PRIMER_TYPE}"]
        create_topics(stack.bootstrap, topics, latency.PARTITIONS)
        work = stack.workdir / f"{prefix}.connect"
        worker = new_worker(work, stack.bootstrap, prefix, properties,
                            jvm_options(work / "gc.log"))  # fmt: skip
        peer = cls(worker, topics[0])
        primer: list[Tally] = []

        @contextmanager
        def launch() -> Iterator[Side]:
            worker.start()
            worker.create(connector_config(properties))
            primer.append(_primer(url))
            yield Side(lambda: [worker.pid], peer.check)

        try:
            _, seen = _consume_all(stack.bootstrap, topics[1], 1, 0, launch, 600)
            seen.check(primer[0], topics[1])
            worker.stop_connector()
        except (LocalServerError, ArtifactFetchError, RuntimeError) as exc:
            logger.warning("Kafka Connect (KIP-618) left out: %s", exc, exc_info=True,
                           extra={"event": "bench.connect_failed"})  # fmt: skip
            worker.stop()
            return cls(None, why_not=f"{type(exc).__name__}: {str(exc)[:500]}; see {work}")
        return peer

    def check(self) -> None:
        if self.worker is not None and not self.worker.running:
            raise RuntimeError(f"Kafka Connect exited; its log: {self.worker.log_path}")

    @contextmanager
    def running(self) -> Iterator[Side]:
        """The connector resumed for the block (the worker keeps running)."""
        worker = self.worker
        assert worker is not None
        worker.resume_connector()
        try:
            yield Side(lambda: [worker.pid], self.check)
        finally:
            worker.stop_connector()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()


@contextmanager
def _logical_postgres(stack: Stack) -> Iterator[LocalPostgres]:
    server = LocalPostgres(
        stack.workdir / "pg-logical",
        fsync=stack.postgres.fsync,
        # No walsender timeout: Debezium Server's process is suspended through the other
        # sides' latency rounds (_suspended), longer than the default minute at `full`.
        settings={"wal_level": "logical", "wal_sender_timeout": "0"},
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
        ROUTER_TOPIC: prefix + ".${routedByValue}",
        f"{router}.table.fields.additional.placement": (
            "event_type:header:event_type,aggregate_type:header:aggregate_type"
        ),
        "debezium.format.key": "simplestring",
        "debezium.format.value": "simplestring",
        # Headers can only be JSON: the id header arrives quoted (latency.id_header strips it).
        "debezium.format.header": "json",
        "debezium.format.header.schemas.enable": "false",
        **THROUGHPUT_TUNING,
    }


def jvm_options(gc_log: Path) -> list[str]:
    """A fixed heap of ``HEAP`` and the GC logged to ``gc_log``."""
    return [f"-Xms{HEAP}", f"-Xmx{HEAP}", f"-Xlog:gc*:file={gc_log}:uptime,level,tags"]


_PAUSE = re.compile(r"\[gc\s*\] GC\(\d+\) Pause.* (\d+(?:\.\d+)?)ms\s*$", re.M)


def gc_pauses(log: str) -> dict[str, float]:
    """The stop-the-world pauses a unified GC log (``-Xlog:gc*``) reports: how many, and
    their total and longest in milliseconds."""
    pauses = [float(ms) for ms in _PAUSE.findall(log)]
    return {
        "gc_pauses": len(pauses),
        "gc_pause_ms": round(sum(pauses), 1),
        "gc_max_pause_ms": max(pauses, default=0.0),
    }


def _route_to(debezium: LocalDebeziumServer, prefix: str, gc_log: Path) -> None:
    """Where the next start of ``debezium`` publishes (``<prefix>.<aggregate_type>``),
    and where it logs its GC."""
    debezium.properties[ROUTER_TOPIC] = prefix + ".${routedByValue}"
    debezium.jvm_options = tuple(jvm_options(gc_log))


def _create_slot(stack: Stack, url: str, debezium: LocalDebeziumServer, prefix: str) -> None:
    """Debezium's first start creates its slot and publication; it is stopped once it
    has published a primer row (a stop stores the offset of what it published)."""
    primer = f"{prefix}.{PRIMER_TYPE}"
    create_topics(stack.bootstrap, [primer], latency.PARTITIONS)
    _route_to(debezium, prefix, debezium.work_dir / "gc-primer.log")
    written: list[Tally] = []

    @contextmanager
    def launch() -> Iterator[Side]:
        with _debezium_running(debezium, url) as side:  # streaming: the slot exists
            written.append(_primer(url))
            yield side

    _, seen = _consume_all(stack.bootstrap, primer, 1, 0, launch, 300)
    seen.check(written[0], primer)


def _primer(url: str) -> Tally:
    """Write the primer row; its tally."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES (%s, '0', 'OrderPlaced', %s) RETURNING message_id::text",
            (PRIMER_TYPE, json.dumps(order_payload())),
        ).fetchone()
    assert row is not None
    return Tally.of([row[0]])


# -- one instrument: a counting, tallying consumer -------------------------------------

_MASK = 2**64 - 1


@dataclass
class Tally:
    """How many records a consumer saw, and the sum (mod 2**64) of their ids' low 64
    bits. Two tallies are equal when the same ids arrived, each once: a record lost, or
    one received twice, changes the count; one lost *and* another twice changes the sum
    (unless two random ids share 64 bits)."""

    count: int = 0
    digest: int = 0

    def add(self, record_id: str) -> None:
        self.count += 1
        self.digest = (self.digest + uuid.UUID(record_id).int) & _MASK

    @classmethod
    def of(cls, ids: Iterable[str]) -> Tally:
        tally = cls()
        for record_id in ids:
            tally.add(record_id)
        return tally

    def check(self, written: Tally, what: str) -> None:
        """Raise unless every written record arrived exactly once."""
        if self.count != written.count:
            raise RuntimeError(
                f"{what}: {self.count} records for {written.count} rows written "
                "(some lost or duplicated)"
            )
        if self.digest != written.digest:
            raise RuntimeError(
                f"{what}: {self.count} records, as many as rows written, but not their ids "
                "(some lost and as many duplicated)"
            )


@dataclass(frozen=True)
class Span:
    """What a counting consumer saw: (CLOCK_MONOTONIC time, records so far) after every
    batch it received, up to the batch that completed the expected count."""

    points: list[tuple[float, int]]

    @classmethod
    def upto(cls, points: list[tuple[float, int]], expected: int) -> Span:
        end = next((n for n, (_, count) in enumerate(points) if count >= expected), None)
        return cls(points if end is None else points[: end + 1])

    def ev_s(self, skip: int = 0) -> float:
        """Records per second from the batch that brought the count to at least ``skip``
        (its records excluded) to the last."""
        start, before = next(p for p in self.points if p[1] >= max(1, skip))
        end, count = self.points[-1]
        return (count - before) / (end - start) if end > start else math.nan


@dataclass
class Side:
    """A running side: the pids whose CPU it uses, and a check that it still runs."""

    pids: Callable[[], list[int | None]]
    check: Callable[[], None]


Launch = Callable[[], AbstractContextManager[Side]]


@dataclass
class Run:
    rate: float
    details: dict[str, Any] = field(default_factory=dict)


def _consume_all(
    bootstrap: str, topic: str, expected: int, warmup: int, launch: Launch, timeout: float,
    roots: dict[str, Callable[[], list[int | None]]] | None = None,
) -> tuple[Run, Tally]:  # fmt: skip
    """Count ``topic`` from its current end until ``expected`` records arrived, with the
    side started by ``launch`` once the consumer is assigned; the rate and CPU are
    taken over the records after the first ``warmup``. Returns them and the tally of
    what arrived (check it against what was written)."""
    ready, stop = SPAWN.Event(), SPAWN.Event()
    received = SPAWN.Value("q", 0)
    consumer, results = spawn_child(_count, bootstrap, topic, expected, ready, stop, received)
    try:
        wait_until(ready.is_set, consumer, 30.0, "the consumer to be assigned")
        with launch() as side:

            def reached(count: int) -> Callable[[], bool]:
                def done() -> bool:
                    side.check()
                    return bool(received.value >= count)

                return done

            wait_until(reached(max(1, warmup)), consumer, timeout, "the warm-up records")
            # The consumer too: it shares the two cores, so it is part of the budget.
            counter = {"consumer": lambda: [consumer.pid]}
            with CpuMeter(
                {"side": side.pids, **(roots or {}), **counter}, alone=counter.keys()
            ) as meter:
                wait_until(reached(expected), consumer, timeout, "every record")
                meter.sample()
        points, tally = receive(results, consumer, 30.0)
    finally:
        stop.set()
        reap(consumer)
    span = Span.upto(points, expected)
    measured = expected - warmup
    return Run(span.ev_s(warmup), {
        "records": expected, "measured": measured,
        "seconds": round(span.points[-1][0] - next(t for t, c in span.points if c >= warmup), 3),
        **{f"cpu_us_per_event_{name}": round(s / measured * 1e6, 2)
           for name, s in meter.seconds.items()},
        **meter.as_json(),
    }), tally  # fmt: skip


def _count(
    bootstrap: str,
    topic: str,
    expected: int,
    ready: Event,
    stop: Event,
    received: Synchronized[int],
    out: Connection,
) -> None:
    """Tally every record of ``topic`` until ``expected`` (and ``EXTRA_S`` more, to see
    duplicates); send the points and the tally."""
    consumer = latency.committed_reader(bootstrap, "debezium")
    points: list[tuple[float, int]] = []
    tally = Tally()
    complete: float | None = None
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        # From the end as it is now: the side starts after ``ready``, and a topic that a
        # side publishes to in every round (Kafka Connect's) holds earlier rounds.
        ends = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in partitions]  # fmt: skip
        consumer.assign(
            [TopicPartition(topic, p, end) for p, end in zip(partitions, ends, strict=True)]
        )
        consumer.consume(1, 0.5)  # joins
        ready.set()
        while not stop.is_set() and (complete is None or time.monotonic() < complete):
            got = 0
            for msg in consumer.consume(10_000, 0.05):
                if msg.error() is None:
                    tally.add(latency.id_header(msg))
                    got += 1
            if got:
                points.append((time.monotonic(), tally.count))
                received.value = tally.count
            if complete is None and tally.count >= expected:
                complete = time.monotonic() + EXTRA_S
    finally:
        consumer.close()
    out.send((points, tally))


# -- backlog throughput ----------------------------------------------------------------


class _Backlog:
    """The sides of the backlog comparison; each call is one round of one side."""

    def __init__(
        self, stack: Stack, scale: Scale, server: LocalPostgres, url: str,
        debezium: LocalDebeziumServer, connect: _ConnectPeer,
    ) -> None:  # fmt: skip
        self.stack, self.scale, self.server, self.url = stack, scale, server, url
        self.dbz = debezium
        self.peer = connect
        self.rounds: dict[str, list[dict[str, Any]]] = {}
        self.written = Tally()
        self.filled = 0  # rounds whose rows have been written
        self.timeout = 120 + (scale.debezium_warmup + scale.debezium_events) / 500

    def _roots(self) -> dict[str, Callable[[], list[int | None]]]:
        return {"postgres": lambda: [self.server.pid], "broker": lambda: [self.stack.broker.pid]}

    def _round_rows(self, name: str) -> None:
        """The first side to run in a round writes its rows: interleave reverses every
        other round, and Debezium Server and Kafka Connect stream only rows written
        after their last run, whichever of them runs first."""
        if len(self.rounds.get(name, [])) == self.filled:
            self._refill()
            self.filled += 1

    def _refill(self) -> None:
        """This round's rows: the outbox emptied and filled again, then settled."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")
        fill_outbox(
            self.url,
            self.scale.debezium_warmup + self.scale.debezium_events,
            chunk=ROWS_PER_TRANSACTION,
        )
        with psycopg.connect(self.url, autocommit=True) as conn, conn.cursor() as cur:
            cur.execute("SELECT message_id::text FROM outbox")
            self.written = Tally.of(row[0] for row in cur)
        settle(self.url)

    def debezium(self) -> float:
        """Debezium's round (it streams only what is written after its slot's offset)."""
        self._round_rows(DEBEZIUM)
        prefix = self.stack.topic_prefix("debezium")
        topic = f"{prefix}.{BACKLOG_TYPE}"
        create_topics(self.stack.bootstrap, [topic], latency.PARTITIONS)
        n = len(self.rounds.get(DEBEZIUM, []))
        gc_log = self.dbz.work_dir / f"gc-backlog-{n}.log"
        _route_to(self.dbz, prefix, gc_log)
        run = self._measure(topic, lambda: _debezium_running(self.dbz))
        details = {**run.details, **gc_pauses(gc_log.read_text()), "gc_log": str(gc_log)}
        self.rounds.setdefault(DEBEZIUM, []).append(details)
        return run.rate

    def connect(self) -> float:
        """Kafka Connect's round, on the round's rows."""
        self._round_rows(CONNECT)
        settle(self.url)
        run = self._measure(self.peer.topic, self.peer.running)
        self.rounds.setdefault(CONNECT, []).append(run.details)
        return run.rate

    def relay(self, name: str) -> Callable[[], float]:
        side = RELAY_SIDES[name]

        def once() -> float:
            label = f"debezium-relay-{side.delivery}-w{side.workers}"
            topic = f"{self.stack.topic_prefix(label)}.orders"
            create_topics(self.stack.bootstrap, [topic], latency.PARTITIONS)
            self._round_rows(name)
            n = len(self.rounds.get(name, []))
            subscriber = Subscriber(f"{side.delivery}{n}w{side.workers}", topic=topic,
                                    value_format=ValueFormat.JSON, parts=side.parts)  # fmt: skip
            fresh_subscribers(self.url, [subscriber])
            settle(self.url)
            owners: dict[str, Any] = {}
            run = self._measure(
                topic,
                lambda: _relay_running(self.stack, self.url, label, side, subscriber.name, owners),
            )
            details = {**run.details, **owners, "rows_per_part": _rows_per_part(self.url, side)}
            self.rounds.setdefault(name, []).append(details)
            return run.rate

        return once

    def _measure(self, topic: str, launch: Launch) -> Run:
        run, seen = _consume_all(
            self.stack.bootstrap, topic, self.written.count, self.scale.debezium_warmup,
            launch, self.timeout, self._roots(),
        )  # fmt: skip
        seen.check(self.written, topic)
        # As it goes: a long run that fails later still shows its rounds.
        print(f"debezium: {topic} {run.rate:,.0f} ev/s {run.details}", file=sys.stderr, flush=True)
        return run


@contextmanager
def _debezium_running(
    debezium: LocalDebeziumServer, url: str | None = None, *, keep: bool = False
) -> Iterator[Side]:
    """Debezium Server for the block (streaming, if ``url`` is given); left running
    after it with ``keep``, unless the block fails."""
    debezium.start()
    try:
        if url is not None:
            debezium.wait_streaming(url)

        def check() -> None:
            if not debezium.running:
                raise RuntimeError(f"Debezium Server exited; its log: {debezium.log_path}")

        yield Side(lambda: [debezium.pid], check)
    except BaseException:
        debezium.stop()
        raise
    if not keep:
        debezium.stop()


@contextmanager
def _relay_running(
    stack: Stack, url: str, label: str, side: RelaySide, subscriber: str, notes: dict[str, Any]
) -> Iterator[Side]:
    """``outbox-relay run`` with the side's workers, default settings otherwise. With
    several members, the subscriber is paused until its parts have spread over them: the
    first member up claims every part, and the hand-over is not the steady state (the
    warm-up records come after it)."""
    workers = {"workers": side.workers} if side.workers > 1 else {}
    with RelayProcesses(stack, url, label, delivery=side.delivery, **workers) as relays:
        if side.workers > 1:
            set_paused(url, subscriber, paused=True)
            wait_spread(url, side.parts, side.workers, relays.check_alive)
            set_paused(url, subscriber, paused=False)
        # The supervisor's tree: its member processes count (CpuMeter reads descendants).
        yield Side(lambda: [p.pid for p in relays.procs], relays.check_alive)
        notes["owners_at_end"] = _owners(url)  # still running: did the parts stay spread?


def _owners(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(DISTINCT owner) FROM outbox_checkpoints").fetchone()
    return int(row[0]) if row else 0


def _rows_per_part(url: str, side: RelaySide) -> list[int]:
    """How the round's rows fell over the subscriber's parts (the key hash the relay
    reads them by): an uneven split leaves one member with more to do."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT outbox_part(aggregate_id, %s), count(*) FROM outbox GROUP BY 1 ORDER BY 1",
            (side.parts,),
        ).fetchall()
    return [int(count) for _, count in rows]


# -- latency ---------------------------------------------------------------------------


def _latency_rounds(
    stack: Stack, scale: Scale, server: LocalPostgres, url: str, debezium: LocalDebeziumServer
) -> dict[str, list[latency.Samples]]:
    """Every side's latency runs, one per round, interleaved."""
    runs: dict[str, list[latency.Samples]] = {}
    debezium.properties.update(LATENCY_TUNING)
    with _warm_latency_server(stack, scale, url, debezium):

        def debezium_round() -> latency.Samples:
            n = len(runs.get(DEBEZIUM, []))
            prefix = debezium.properties[ROUTER_TOPIC].removesuffix(".${routedByValue}")
            routes = [f"r{n}-{route}" for route in latency.aggregate_types(scale)]
            topics = [f"{prefix}.{route}" for route in routes]
            create_topics(stack.bootstrap, topics, latency.PARTITIONS)
            stamps, _, arrivals = latency.measure(
                stack.bootstrap, topics, scale, ("outbox", [url, *routes])
            )
            # Its sink has no transactions: events per transaction is left out.
            return latency.samples_of(stamps, arrivals, scale, per_transaction=1.0)

        def relay_round(mode: str) -> Callable[[], latency.Samples]:
            def once() -> latency.Samples:
                db = stack.database("latency", server)
                return latency.relay_latency(stack, scale, db, mode, value_format="json")

            return once

        def side(name: str, measure: Callable[[], latency.Samples]) -> Callable[[], float]:
            def once() -> float:
                with nullcontext() if name == DEBEZIUM else _suspended(debezium):
                    runs.setdefault(name, []).append(measure())
                summary = _summary(name, runs[name][-1])
                print(f"debezium latency: {name} {summary}", file=sys.stderr, flush=True)
                return runs[name][-1].ms(0.5)

            return once

        def floor_round(producer: str) -> Callable[[], latency.Samples]:
            return lambda: latency.broker_floor(stack, scale, producer)

        def relay_warm_up(mode: str) -> Callable[[Scale], latency.Samples]:
            def once(short: Scale) -> latency.Samples:
                db = stack.database("latency", server)
                return latency.relay_latency(stack, short, db, mode, value_format="json")

            return once

        # Debezium Server drained its warm-up backlog; the broker's transactions and the
        # relay's runs warm up here.
        with _suspended(debezium):
            latency.warm_up(stack, scale, *map(relay_warm_up, MODES.values()))

        interleave(
            {DEBEZIUM: side(DEBEZIUM, debezium_round),
             **{name: side(name, relay_round(mode)) for name, mode in MODES.items()},
             **{name: side(name, floor_round(producer)) for name, producer in FLOORS.items()}},
            scale.repetitions,
        )  # fmt: skip
    return runs


@contextmanager
def _warm_latency_server(
    stack: Stack, scale: Scale, url: str, debezium: LocalDebeziumServer
) -> Iterator[None]:
    """Debezium with its latency settings, running, after draining a warm-up backlog."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    fill_outbox(url, scale.debezium_warmup, chunk=ROWS_PER_TRANSACTION)
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute("SELECT message_id::text FROM outbox")
        written = Tally.of(row[0] for row in cur)
    prefix = stack.topic_prefix("debezium-latency")
    create_topics(stack.bootstrap, [f"{prefix}.{BACKLOG_TYPE}"], latency.PARTITIONS)
    _route_to(debezium, prefix, debezium.work_dir / "gc-latency.log")
    timeout = 120 + scale.debezium_warmup / 500
    try:
        topic = f"{prefix}.{BACKLOG_TYPE}"
        _, seen = _consume_all(stack.bootstrap, topic, written.count, 0,
                               lambda: _debezium_running(debezium, keep=True), timeout)  # fmt: skip
        seen.check(written, topic)
        settle(url)
        yield
    finally:
        debezium.stop()


@contextmanager
def _suspended(debezium: LocalDebeziumServer) -> Iterator[None]:
    """Debezium Server stopped in its tracks (SIGSTOP) for the block, then resumed: no
    side's round shares the two cores with another side's process. A resumed JVM keeps
    its compiled code, so its rounds stay warm without a new warm-up backlog."""
    pid = debezium.pid
    if pid is None:
        raise RuntimeError(f"Debezium Server is not running; its log: {debezium.log_path}")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):  # it died meanwhile: said below
            os.kill(pid, signal.SIGCONT)
    time.sleep(RESUMED_S)
    if not debezium.running:
        raise RuntimeError(f"Debezium Server exited; its log: {debezium.log_path}")


# -- figures ---------------------------------------------------------------------------

VALUES = "JSON payload: relay value_format=json, Debezium simplestring"


def _settings(tuning: dict[str, str]) -> dict[str, str]:
    return {name.removeprefix("debezium."): value for name, value in tuning.items()}


def _throughput_figures(
    rates: dict[str, Samples],
    rounds: dict[str, list[dict[str, Any]]],
    scale: Scale,
    connect_why_not: str | None,
) -> list[Figure]:
    details = {
        "warmup_events": scale.debezium_warmup,
        "events": scale.debezium_events,
        "rows_per_transaction": ROWS_PER_TRANSACTION,
        "values": VALUES,
        "instrument": "one read_committed consumer per run, every record's id tallied",
        "rounds": rounds,
        "debezium_settings": _settings(THROUGHPUT_TUNING),
        "debezium_jvm": jvm_options(Path("<gc log>")),
        "kafka_connect_exactly_once": connect_why_not or "measured",
    }
    debezium = rates[DEBEZIUM]
    cpu = {name: Samples(tuple(r["cpu_us_per_event_side"] for r in runs))
           for name, runs in rounds.items()}  # fmt: skip
    baseline = f"{DEBEZIUM}, warm, same rows"
    jvm = "Debezium Server JVM CPU per event"
    figures = []
    # (side, throughput figure, CPU figure, target): the names of earlier runs kept.
    many = f"relay exactly-once, {WORKERS} workers x {WORKER_PARTS} parts"
    for name, rate_figure, cpu_figure, target in (
        (EXACTLY_ONCE, "relay exactly-once ev/s vs Debezium (at-least-once)",
         "relay exactly-once CPU us/event vs Debezium JVM", "ratio>=2"),
        (WORKERS_EXACTLY_ONCE, f"{many} ev/s vs Debezium Server",
         f"{many}, CPU us/event (process tree) vs Debezium JVM", "ratio>=2"),
        (IDEMPOTENT, "relay at-least-once (idempotent) ev/s vs Debezium",
         "relay at-least-once CPU us/event vs Debezium JVM", None),
    ):  # fmt: skip
        if name in rates:
            figures += [
                Figure.of("debezium", rate_figure, rates[name], "ev/s", debezium, baseline,
                          target, details),
                Figure.of("debezium", cpu_figure, cpu[name], "us", cpu[DEBEZIUM], jvm),
            ]  # fmt: skip
    if CONNECT in rates and EXACTLY_ONCE in rates:
        figures += [
            Figure.of("debezium", "relay exactly-once ev/s vs Kafka Connect exactly-once",
                      rates[EXACTLY_ONCE], "ev/s", rates[CONNECT], f"{CONNECT}, warm, same rows",
                      "ratio>=2", details),
            Figure.of("debezium", "relay exactly-once CPU us/event vs Kafka Connect",
                      cpu[EXACTLY_ONCE], "us", cpu[CONNECT],
                      "Kafka Connect worker JVM CPU per event"),
        ]  # fmt: skip
    return figures


def _latency_figures(runs: dict[str, list[latency.Samples]], scale: Scale) -> list[Figure]:
    """p50 (the targets) and p99 (reported only) of each relay mode against Debezium's."""
    details = {
        "rate": scale.latency_rate,
        "values": VALUES,
        "rounds": {name: [_summary(name, s) for s in r] for name, r in runs.items()},
        "debezium_settings": _settings(LATENCY_TUNING),
    }
    figures = []
    for name, p50_target in ((IDEMPOTENT, "ratio<=0.5"), (EXACTLY_ONCE, "ratio<=2")):
        for label, quantile, target in (("p50", 0.5, p50_target), ("p99", 0.99, None)):
            figures.append(Figure.of(
                "debezium", f"commit to visible {label}, {name} vs Debezium",
                Samples(tuple(s.ms(quantile) for s in runs[name])), "ms",
                Samples(tuple(s.ms(quantile) for s in runs[DEBEZIUM])),
                f"{DEBEZIUM} {label}, linger.ms=0, poll.interval.ms=1", target, details,
            ))  # fmt: skip
    if FLOOR_IDEMPOTENT not in runs:
        return figures
    # How far the targets above are reachable at all: a relay's latency is its floor's
    # plus its own work (finding the rows, a Postgres round trip at least), so a floor
    # above a target's ratio of Debezium's p50 puts that target out of any relay's reach
    # on this machine (a transactional floor above 2x: exactly-once <= 2x).
    for floor, bound in ((FLOOR_IDEMPOTENT, 0.5), (FLOOR_TRANSACTIONAL, 2.0)):
        figures.append(Figure.of(
            "debezium", f"commit to visible p50, {floor} vs Debezium",
            Samples(tuple(s.ms(0.5) for s in runs[floor])), "ms",
            Samples(tuple(s.ms(0.5) for s in runs[DEBEZIUM])), f"{DEBEZIUM} p50", None,
            {**details, "reachable_if_ratio_below": bound},
        ))  # fmt: skip
    for name, floor in MODE_FLOORS.items():
        figures.append(Figure.of(
            "debezium", f"commit to visible p50, {name} vs its floor in this run",
            Samples(tuple(s.ms(0.5) for s in runs[name])), "ms",
            Samples(tuple(s.ms(0.5) for s in runs[floor])), f"{floor} p50", None, details,
        ))  # fmt: skip
    return figures


def _summary(name: str, samples: latency.Samples) -> dict[str, Any]:
    summary = latency.summary(samples)
    if name == DEBEZIUM:
        del summary["events_per_transaction"]  # its sink has no transactions
    return summary
