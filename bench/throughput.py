"""Relay throughput: 300-byte Avro events, default (transactional) delivery.

Baseline: the same rows read with a plain keyset query (the relay's own batch size)
and produced as-is with a plain idempotent confluent-kafka producer, flushed once at
the end: the cost of moving the bytes with no relay logic. A second baseline, reported
without a target, does the same with one Kafka transaction per batch: the broker's part
of exactly-once, without the relay's encoding, headers and checkpoints. Relay: an in-process relay
publishing the same backlog; its rate runs from its first checkpoint to its last, so
start-up (connections, fencing, recovery) is left out as it is for the baseline.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from confluent_kafka import Producer

from bench.harness import (
    BATCH,
    Figure,
    Scale,
    Stack,
    create_topics,
    fill_outbox,
    final_positions,
    relay_settings,
    subscriber,
    wait_published,
)
from relay.daemon import Relay, tune_gc


def run(stack: Stack, scale: Scale) -> list[Figure]:
    url = stack.database("throughput")
    fill_outbox(url, scale.events)
    base = baseline(url, stack.bootstrap, f"{stack.topic_prefix('baseline')}.orders")
    transactional = baseline(
        url, stack.bootstrap, f"{stack.topic_prefix('txn-baseline')}.orders", transactions=True
    )
    rate, details = relay_rate(stack, url, scale.events)
    return [
        Figure("throughput", "relay ev/s vs keyset read + produce", rate, "ev/s", base,
               "keyset read + plain produce", "ratio>=0.5", details),
        Figure("throughput", "relay ev/s vs keyset read + transactional produce", rate,
               "ev/s", transactional, "keyset read + a Kafka transaction per batch", None,
               details),
        Figure("throughput", "relay ev/s, absolute", rate, "ev/s", target="value>=100000"),
    ]  # fmt: skip


def baseline(url: str, bootstrap: str, topic: str, *, transactions: bool = False) -> float:
    create_topics(bootstrap, [topic], 3)  # as many partitions as the relay's topics
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "enable.idempotence": True}
    if transactions:
        config["transactional.id"] = f"{topic}.baseline"
    producer = Producer(config)
    if transactions:
        producer.init_transactions()
    produced = 0
    start = time.perf_counter()
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
            if transactions:
                producer.begin_transaction()
            for _, _, key, value in rows:
                _produce(producer, topic, value.encode(), key.encode())
            if transactions:
                producer.commit_transaction()
            produced += len(rows)
            after = (rows[-1][0], rows[-1][1])
    producer.flush()
    return produced / (time.perf_counter() - start)


def _produce(producer: Producer, topic: str, value: bytes, key: bytes) -> None:
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:
            producer.poll(0.005)


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
    tune_gc()  # as `outbox-relay run` does
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
