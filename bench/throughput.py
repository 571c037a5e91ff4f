"""Relay throughput: 300-byte Avro events, default (transactional) delivery, against the
ceilings of each step it takes, all measured in the same run (bench/README.md "Method").

Relay: one ``outbox-relay run`` process publishing the whole backlog to a subscriber of
its own; the subscriber starts paused and the clock runs from its resume to its last
checkpoint, so start-up is left out and the first batch is in, as for every ceiling.
Every repetition publishes the same backlog again, through a new subscriber and topic:
once with Avro values, once with JSON values. The relay's CPU per event (``utime +
stime`` of its process over the window, every thread's, librdkafka's included, over the
events) is a figure of its own: unlike a rate, it holds on a loaded machine.

Ceilings, each one step of the relay's work done alone, on the same rows:

* **raw produce**, idempotent and transactional: the relay's own records (the Avro
  value, key and headers of a row, as its encoder makes them) produced from memory, in
  batches of the relay's batch size: a flush per batch, or a Kafka transaction per batch.
* **COPY-out**: the same rows and columns read by ``COPY ... TO STDOUT (FORMAT binary)``.
* **encode-only**: the relay's encoder (``RecordEncoder``) over events already in
  memory, Avro and JSON values.

Baselines (with the old targets): the rows read with a plain keyset query (the relay's
batch size) and their ``payload::text`` produced as-is, with a flush at the end, or with
a Kafka transaction per batch: moving the bytes with no relay logic.

With ``OUTBOX_BENCH_BASELINE_CODE`` naming a checkout of the code before (bench/bounded.py),
the relay of that checkout publishes the same backlog too, Avro and JSON, each run right
after this relay's: its CPU per event is the baseline of this one's, same run, interleaved.

Each side runs ``scale.repetitions`` times, interleaved, after a CHECKPOINT and a pause;
figures are medians with their range, and the CPU each process used is in the details.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Producer

from bench.harness import (
    BASELINE_CODE,
    BATCH,
    REPO,
    SCHEMAS,
    Figure,
    Scale,
    Stack,
    client_meter,
    create_topics,
    fill_outbox,
    final_positions,
    fresh_subscribers,
    paused_drain,
    relay_settings,
    stopwatch,
    subscriber,
    wait_published,
)
from bench.method import Samples, interleave, settle
from relay.core.model import KafkaRecord, OutboxEvent
from relay.core.schemas import SchemaFolder
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon import Relay, tune_process
from relay.engine.encoding import RecordEncoder

# Events held in memory for the encode-only and raw-produce loops, used round and round:
# a rate per event does not need every row in memory at once.
SAMPLE = 20_000
COLUMNS = (
    "transaction_id::text::bigint, position, message_id, aggregate_type, aggregate_id,"
    " aggregate_version, event_type, payload, headers, occurred_at"
)


class Sides:
    """Every side of the comparison, over one backlog; each call is one repetition."""

    def __init__(self, stack: Stack, url: str, events: int) -> None:
        self.stack, self.url, self.events = stack, url, events
        self.cpu: dict[str, list[dict[str, float]]] = {}
        self.cpu_us: dict[str, list[float]] = {}  # the relay's CPU µs per event, per run
        self.rounds = 0
        sample = load_events(url, min(events, SAMPLE))
        self.sample = sample
        self.records = records_of(sample, ValueFormat.AVRO)  # the relay's own records

    def _metered(self, side: str, run: Callable[[], int]) -> float:
        with client_meter(self.stack) as meter, stopwatch() as elapsed:
            done = run()
        self.cpu.setdefault(side, []).append(meter.as_json())
        return done / elapsed[0]

    def relay(
        self, value_format: ValueFormat = ValueFormat.AVRO, code: Path = REPO, side: str = ""
    ) -> float:
        self.rounds += 1
        side = side or _relay_side(value_format)
        topic = f"{self.stack.topic_prefix('relay')}.orders"
        fresh_subscribers(
            self.url, [Subscriber(f"bench{self.rounds}", topic=topic, value_format=value_format)]
        )
        drain = paused_drain(self.stack, self.url, "throughput", 1, code=code, batch_size=BATCH)
        self.cpu.setdefault(side, []).append(drain.cpu)
        cpu_seconds = drain.cpu.get("cpu_cores_relay", 0.0) * drain.seconds
        self.cpu_us.setdefault(side, []).append(cpu_seconds / self.events * 1e6)
        return self.events / drain.seconds

    def raw_produce(self, transactional: bool) -> float:
        topic = f"{self.stack.topic_prefix('raw')}.orders"
        create_topics(self.stack.bootstrap, [topic], 3)  # as the relay creates its topics
        producer = ceiling_producer(self.stack.bootstrap, topic if transactional else None)
        side = "raw produce, transactional" if transactional else "raw produce, idempotent"
        return self._metered(
            side, lambda: produce_batches(producer, topic, self.records, self.events, transactional)
        )

    def copy_out(self) -> float:
        return self._metered("COPY-out", lambda: copy_out(self.url))

    def encode_only(self, value_format: ValueFormat) -> float:
        return self._metered(
            f"encode {value_format.value}",
            lambda: encode_loop(self.sample, value_format, self.events),
        )

    def keyset(self, transactional: bool) -> float:
        topic = f"{self.stack.topic_prefix('keyset')}.orders"
        create_topics(self.stack.bootstrap, [topic], 3)
        producer = ceiling_producer(self.stack.bootstrap, topic if transactional else None)
        side = "keyset + transactional produce" if transactional else "keyset + produce"
        return self._metered(side, lambda: keyset_produce(self.url, producer, topic, transactional))

    def cpu_medians(self, side: str) -> dict[str, float]:
        runs = self.cpu.get(side, [])
        names = {name for run in runs for name in run}
        return {name: round(statistics.median(r.get(name, 0.0) for r in runs), 3)
                for name in sorted(names)}  # fmt: skip


def run(stack: Stack, scale: Scale) -> list[Figure]:
    url = stack.database("throughput")
    fill_outbox(url, scale.throughput_events)
    settle(url)
    sides = Sides(stack, url, scale.throughput_events)
    baseline = os.environ.get(BASELINE_CODE)
    before = {} if not baseline else {
        "relay before": lambda: sides.relay(ValueFormat.AVRO, Path(baseline), "relay before"),
        "relay json before": lambda: sides.relay(ValueFormat.JSON, Path(baseline),
                                                 "relay json before"),
    }  # fmt: skip
    plan: dict[str, Callable[[], float]] = {
        "relay": sides.relay,
        **{k: v for k, v in before.items() if k == "relay before"},
        "relay json": lambda: sides.relay(ValueFormat.JSON),
        **{k: v for k, v in before.items() if k == "relay json before"},
        "raw produce, idempotent": lambda: sides.raw_produce(False),
        "raw produce, transactional": lambda: sides.raw_produce(True),
        "COPY-out": sides.copy_out,
        "encode avro": lambda: sides.encode_only(ValueFormat.AVRO),
        "encode json": lambda: sides.encode_only(ValueFormat.JSON),
        "keyset + produce": lambda: sides.keyset(False),
        "keyset + transactional produce": lambda: sides.keyset(True),
    }
    samples = interleave(plan, scale.repetitions, before_each=lambda: settle(url, 1.0))
    relay = samples["relay"]
    common = {
        "events": scale.throughput_events,
        "batch": BATCH,
        "relay_cpu": sides.cpu_medians("relay"),
    }

    def versus(
        side: str, target: str | None = None, what: str = "ceiling", relay_side: str = "relay"
    ) -> Figure:
        details = {**common, f"{what}_cpu": sides.cpu_medians(side)}
        if relay_side != "relay":
            details["relay_cpu"] = sides.cpu_medians(relay_side)
        return Figure.of("throughput", f"{relay_side} ev/s vs {side}", samples[relay_side],
                         "ev/s", samples[side], f"{side} ({what})", target,
                         details)  # fmt: skip

    def cpu_per_event(side: str) -> Figure:
        # Issue #31's target: 6 µs per event, 1 part, 300 B, transactional.
        return Figure.of("throughput", f"{side} CPU per event (transactional)",
                         Samples(tuple(sides.cpu_us[side])), "µs", target="value<=6",
                         details={**common, "relay_cpu": sides.cpu_medians(side)})  # fmt: skip

    def cpu_versus_before(side: str) -> Figure:
        # The code before, same run, interleaved: a ratio above 1.05 is a regression.
        return Figure.of("throughput", f"{side} CPU per event vs the code before",
                         Samples(tuple(sides.cpu_us[side])), "µs",
                         Samples(tuple(sides.cpu_us[f"{side} before"])), f"relay of {baseline}",
                         "ratio<=1.05", {**common, "relay_cpu": sides.cpu_medians(side),
                         "before_cpu": sides.cpu_medians(f"{side} before")})  # fmt: skip

    ab = [cpu_versus_before(side) for side in ("relay", "relay json") if before]
    ab += [versus(f"{side} before", None, "code before", side) for side in ("relay", "relay json")
           if before]  # fmt: skip
    return [
        *ab,
        cpu_per_event("relay"),
        cpu_per_event("relay json"),
        versus("raw produce, idempotent"),
        versus("raw produce, transactional"),
        versus("COPY-out"),
        versus("encode avro"),
        versus("encode json"),
        versus("keyset + produce", "ratio>=0.5", "baseline"),
        # Issue #31: single-part throughput, at least 0.8x the raw read + produce ceiling.
        versus("keyset + transactional produce", "ratio>=0.8", "baseline"),
        versus("keyset + transactional produce", "ratio>=0.8", "baseline", "relay json"),
        Figure.of(
            "throughput",
            "relay ev/s, absolute",
            relay,
            "ev/s",
            target="value>=100000",
            details=common,
        ),
    ]


def _relay_side(value_format: ValueFormat) -> str:
    return "relay" if value_format is ValueFormat.AVRO else f"relay {value_format.value}"


def load_events(url: str, count: int) -> list[OutboxEvent]:
    """The first ``count`` rows as the relay's events (payloads decoded)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT {COLUMNS} FROM outbox ORDER BY transaction_id, position LIMIT %s", (count,)
        ).fetchall()
    return [
        OutboxEvent(tx, pos, message_id, aggregate_type, key, version, event_type, payload,
                    headers or {}, occurred_at)
        for tx, pos, message_id, aggregate_type, key, version, event_type, payload, headers,
        occurred_at in rows
    ]  # fmt: skip


def records_of(events: list[OutboxEvent], value_format: ValueFormat) -> list[KafkaRecord]:
    """The records the relay's encoder makes of ``events``."""
    encoder = RecordEncoder(SchemaFolder.from_dir(SCHEMAS))
    subscriber = Subscriber("bench", topic="bench.orders", value_format=value_format)
    return [encoder.encode(event, subscriber) for event in events]


def encode_loop(events: list[OutboxEvent], value_format: ValueFormat, total: int) -> int:
    """Encode ``total`` events (going round ``events``) with the relay's encoder, a batch
    of the relay's batch size per call, as its worker encodes an unfiltered batch."""
    encoder = RecordEncoder(SchemaFolder.from_dir(SCHEMAS))
    subscriber = Subscriber("bench", topic="bench.orders", value_format=value_format)
    encode_all = encoder.for_batches(subscriber)
    done = 0
    while done < total:
        for start in range(0, min(len(events), total - done), BATCH):
            encode_all(events[start : min(start + BATCH, total - done)])
        done += min(len(events), total - done)
    return done


def produce_batches(
    producer: Producer, topic: str, records: list[KafkaRecord], total: int, transactional: bool
) -> int:
    """``total`` of ``records`` (round and round) in batches of the relay's batch size."""
    if transactional:
        producer.init_transactions()
    sent = 0
    while sent < total:
        batch = min(BATCH, total - sent)
        if transactional:
            producer.begin_transaction()
        for i in range(sent, sent + batch):
            record = records[i % len(records)]
            _produce(producer, topic, record.value or b"", record.key or b"", record.headers)
        if transactional:
            producer.commit_transaction()
        else:
            producer.flush()
        sent += batch
    return sent


def copy_out(url: str) -> int:
    """Read every row's relay columns by binary COPY; returns the rows read."""
    rows = 0
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        query = f"COPY (SELECT {COLUMNS} FROM outbox ORDER BY transaction_id, position) TO STDOUT"
        with cur.copy(query + " (FORMAT binary)") as copy:
            for _ in copy.rows():
                rows += 1
    return rows


def keyset_produce(url: str, producer: Producer, topic: str, transactional: bool) -> int:
    """The rows read with a keyset query and their payload text produced as-is."""
    if transactional:
        producer.init_transactions()
    produced = 0
    with psycopg.connect(url, autocommit=True) as conn:
        after = (0, 0)
        while rows := conn.execute(
            "SELECT transaction_id::text::bigint, position, aggregate_id, payload::text"
            "  FROM outbox o"
            " WHERE (o.transaction_id, o.position) > (%s::text::xid8, %s)"
            "   AND o.transaction_id < pg_snapshot_xmin(pg_current_snapshot())"
            " ORDER BY o.transaction_id, o.position LIMIT %s",
            (*after, BATCH),
        ).fetchall():
            if transactional:
                producer.begin_transaction()
            for _, _, key, value in rows:
                _produce(producer, topic, value.encode(), key.encode())
            if transactional:
                producer.commit_transaction()
            produced += len(rows)
            after = (rows[-1][0], rows[-1][1])
    producer.flush()
    return produced


def ceiling_producer(bootstrap: str, transactional_id: str | None) -> Producer:
    # The relay's safety settings (relay/adapters/kafka/kafka.py producer_config): a
    # ceiling that may lose records is no ceiling.
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "max.in.flight.requests.per.connection": 1,
    }
    if transactional_id is not None:
        config["transactional.id"] = f"{transactional_id}.ceiling"
    return Producer(config)


def _produce(producer: Producer, topic: str, value: bytes, key: bytes, headers: Any = None) -> None:
    while True:
        try:
            producer.produce(topic, value, key, headers=headers)
            return
        except BufferError:
            producer.poll(0.005)


# -- the Debezium comparison's relay side (bench/debezium.py), not yet on the method


def relay_rate(
    stack: Stack, url: str, events: int, topic: str | None = None, **fields: Any
) -> tuple[float, dict[str, float]]:
    """The relay's rate on the backlog of ``url``; ``fields`` go to its subscriber."""
    topic = topic or f"{stack.topic_prefix('relay')}.orders"
    settings = relay_settings(
        stack,
        url,
        "throughput",
        batch_size=BATCH,
        subscribers=[subscriber("bench", topic, **fields)],
    )
    relay = Relay(settings)
    tune_process()  # as `outbox-relay run` does
    relay.start()
    try:
        first, done = wait_published(url, final_positions(url))
    finally:
        relay.stop()
    totals = relay.part_totals()
    published = sum(t["published"] for t in totals.values())
    batches = sum(t["batches"] for t in totals.values())
    # The span starts at the first checkpoint: that first batch is not in it.
    rate = (events - BATCH) / (done - first)
    return rate, {"published": published, "transactions": batches, "seconds": done - first}
