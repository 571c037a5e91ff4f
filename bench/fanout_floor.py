"""The fan-out's floor: the relay's transactions, made by plain clients (issue #53).

``fanout`` compares N one-type subscribers with one unfiltered subscriber of the same rows,
both in batches of a tenth of a subscriber's share: at 1,000 subscribers and ``quick``'s
100k events, 1,000 transactional ids of 10 transactions of 10 records each against one id
of 10,000 such transactions. Whether the relay or the broker limits the N side is what this
side tells: the same transactions by confluent-kafka producers with nothing of the relay
around them (records already encoded, in memory; no Postgres).

A plain client is what the relay's part does with a producer, and no more: a transactional
producer of the part's id (the relay's producer settings) is opened and fenced
(``init_transactions``), then each batch is a transaction of its records (the relay's
encoder's, from rows like the fill's), with the checkpoint's two offsets sent to a group of
its own, and committed; then the producer is closed. As many producers are open at once as
the relay's pool holds (``max_producers``, 8 by default): each of that many threads takes
the next subscriber until none is left. The one-subscriber side is one such client for
every record. Both are clocked as the relay's #53 clock is: from the first record's
timestamp to the last's (or its commit marker's), over every topic of the side.
"""

from __future__ import annotations

import queue
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bench.harness import SCHEMAS, Stack, create_topics, order_payload
from relay.adapters.kafka.kafka import producer_config, transaction_timeout, transactional_config
from relay.core.model import KafkaRecord, OutboxEvent
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber
from relay.engine.encoding import RecordEncoder

PARTITIONS = 3  # of each subscriber's topic, as fanout's
KEYS = 1000  # aggregate ids, as the fill's
MAX_RETRIES = 10  # transactions a part sends again before its run fails


def plain_publish(
    stack: Stack,
    subscribers: int,
    events: int,
    batch: int,
    clock: Callable[[str, list[str]], float],
) -> float:
    """Publish ``events`` records as ``subscribers`` subscribers' parts would, in
    transactions of ``batch``; the seconds ``clock`` gives from the first record to the
    last of every topic."""
    prefix = stack.topic_prefix(f"floor{subscribers}")
    topics = [f"{prefix}.s{i}" for i in range(subscribers)]
    checkpoints = f"{prefix}.checkpoints"
    create_topics(stack.bootstrap, topics, PARTITIONS)
    create_topics(stack.bootstrap, [checkpoints], 2)
    shares = [events // subscribers + (i < events % subscribers) for i in range(subscribers)]
    jobs: queue.SimpleQueue[tuple[int, list[KafkaRecord]] | None] = queue.SimpleQueue()
    for i, topic in enumerate(topics):
        jobs.put((i, records_for(topic, f"order{i}" if subscribers > 1 else "order", shares[i])))
    settings = Settings()  # the relay's defaults: producer settings, pool size
    workers = min(settings.max_producers, subscribers)
    for _ in range(workers):
        jobs.put(None)
    client = _Client(settings, stack.bootstrap, prefix, checkpoints, batch)
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            while (job := jobs.get()) is not None:
                client.publish(*job)
        except BaseException as exc:  # the run fails, naming it, below
            failures.append(exc)

    threads = [threading.Thread(target=serve, name=f"floor-{n}") for n in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"a plain client failed: {failures[0]!r}") from failures[0]
    if client.retries:  # in the run's log: a side that retried is slower for it
        print(
            f"   plain clients sent {len(client.retries)} transactions again, first: "
            f"{client.retries[0]}",
            file=sys.stderr,
            flush=True,
        )
    return clock(stack.bootstrap, topics)


class _Client:
    """One part's worth of transactions, per call, on a producer of its own."""

    def __init__(
        self, settings: Settings, bootstrap: str, prefix: str, checkpoints: str, batch: int
    ) -> None:
        self._config = producer_config(bootstrap, {}, int(settings.delivery_timeout * 1000))
        self._timeout_s = transaction_timeout(settings.session_timeout)
        self._bootstrap, self._prefix = bootstrap, prefix
        self._checkpoints, self._batch = checkpoints, batch
        self.retries: list[str] = []  # every transaction sent again, and why

    def publish(self, part: int, records: list[KafkaRecord]) -> None:
        name = f"{self._prefix}.s{part}"
        group = _group_metadata(self._bootstrap, f"{name}.checkpoint")
        producer = self._opened(name)
        at, retried = 0, 0
        while at < len(records):
            try:
                self._transaction(producer, group, records[at : at + self._batch], at)
            except KafkaException as exc:
                # As the relay's part does: an abortable failure is aborted and the batch
                # sent again; a fatal one (the broker fenced the producer, a transaction
                # past its timeout on a broker at a full core) or a retriable one (the
                # transaction's state then unknown) opens a new producer, which fences
                # the old one and aborts what it left open.
                error = exc.args[0]
                retried += 1
                if retried > MAX_RETRIES or not (
                    error.txn_requires_abort() or error.fatal() or error.retriable()
                ):
                    raise
                if error.txn_requires_abort():
                    producer.abort_transaction(60)
                else:
                    producer = self._opened(name)
                self.retries.append(f"{name}: {error.str()}")
                continue
            at += self._batch

    def _opened(self, name: str) -> Producer:
        producer = Producer(transactional_config(self._config, name, self._timeout_s))
        producer.init_transactions(60)
        return producer

    def _transaction(
        self, producer: Producer, group: Any, records: list[KafkaRecord], at: int
    ) -> None:
        producer.begin_transaction()
        for record in records:
            producer.produce(record.topic, record.value, record.key, headers=record.headers)
        offsets = [TopicPartition(self._checkpoints, p, at + 1) for p in (0, 1)]
        producer.send_offsets_to_transaction(offsets, group, 60)
        producer.commit_transaction(60)


def _group_metadata(bootstrap: str, group: str) -> Any:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return consumer.consumer_group_metadata()
    finally:
        consumer.close()


def records_for(topic: str, aggregate_type: str, count: int) -> list[KafkaRecord]:
    """``count`` records of ``topic`` as the relay's encoder makes them of the fill's rows
    (its default value format, with the bench's schemas)."""
    encode = RecordEncoder(SchemaFolder.from_dir(SCHEMAS)).for_batches(
        Subscriber("floor", topic=topic)
    )
    now = datetime.now(UTC)
    events = [
        OutboxEvent(
            n // 1000,
            n,
            uuid.uuid4(),
            aggregate_type,
            f"k{n % KEYS}",
            None,
            "OrderPlaced",
            order_payload(n),
            {},
            now,
        )
        for n in range(count)
    ]
    return encode(events)
