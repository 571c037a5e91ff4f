"""``outbox-relay verify``: compare the outbox with what is on the topics.

For each subscriber, every event at or before its part's checkpoint (and matching its
filter) must be on its topic exactly once, and each key's records must appear in
``(transaction_id, position)`` order. Topics are read read_committed, from the start
of the log to its end as of the start of the run.

Records found past a part's checkpoint are reported as *ahead* (a transaction that
committed before its Postgres checkpoint update: the next owner adopts it), not as
errors. After ``subscribers reset`` to an earlier point, republished events are
duplicates by design; verify a fresh subscriber instead.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition

from relay.client_logs import client_logger
from relay.db import wrap_errors
from relay.encoding import HEADER_ID, HEADER_POSITION, HEADER_TRANSACTION_ID
from relay.errors import BrokerUnavailable, ConsumerHiccup, SubscriberError
from relay.kafka_errors import Stage, classify
from relay.model import Position
from relay.queries import queries_for
from relay.store import OutboxStore, SubscriberState

logger = logging.getLogger(__name__)
# librdkafka's own lines: deduplicated, at most one of a kind a minute.
_client_log = client_logger()

_MAX_EXAMPLES = 20  # findings listed per kind; the counts are always complete


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    """What verify needs from a record read off a topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    message_id: str | None
    position: Position | None


class TopicReader(Protocol):
    """Reads whole topics, read_committed, up to their end as of the call."""

    def read(
        self, topics: Sequence[str], progress: Callable[[int, int], None]
    ) -> Iterator[ConsumedRecord]:
        """Yield every committed record; ``progress(done, total)`` reports offsets."""


@dataclass
class SubscriberReport:
    subscriber: str
    topics: list[str]
    expected: int = 0
    found: int = 0
    missing: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    ahead: int = 0  # published past the Postgres checkpoint (recovery adopts them)
    dead_lettered: int = 0
    pending: int = 0  # not yet published: after the checkpoint
    # Parts created with --from now or reset since: events before these are not checked.
    checked_after: list[str] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    @property
    def clean(self) -> bool:
        return not (self.missing or self.duplicated or self.out_of_order)

    def example(self, kind: str, text: str) -> None:
        if len(self.examples[kind]) < _MAX_EXAMPLES:
            self.examples[kind].append(text)

    def as_dict(self) -> dict[str, Any]:
        return {
            "subscriber": self.subscriber,
            "topics": self.topics,
            "expected": self.expected,
            "found": self.found,
            "missing": self.missing,
            "duplicated": self.duplicated,
            "out_of_order": self.out_of_order,
            "ahead": self.ahead,
            "dead_lettered": self.dead_lettered,
            "pending": self.pending,
            "checked_after": self.checked_after,
            "clean": self.clean,
            "examples": dict(self.examples),
        }


@dataclass
class _Expected:
    """Compact expectations: message id bytes → its key in the outbox."""

    positions: dict[bytes, Position] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)


def verify(
    conn: psycopg.Connection[Any],
    schema: str,
    reader: TopicReader,
    *,
    subscribers: Sequence[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SubscriberReport]:
    """One report per subscriber (all of them unless ``subscribers`` names some)."""
    store = OutboxStore(conn, schema)
    states = [s for s in store.list() if subscribers is None or s.subscriber.name in subscribers]
    unknown = set(subscribers or ()) - {s.subscriber.name for s in states}
    if unknown:
        raise SubscriberError(f"no subscriber named {sorted(unknown)}")
    states = _checkable(states, named=subscribers is not None)
    reports = []
    for state in states:
        name = state.subscriber.name
        report, expected = _expectations(conn, schema, state)
        report.pending = state.lag(store)

        def tick(done: int, total: int, name: str = name) -> None:
            if progress is not None:
                progress(name, done, total)

        _compare(report, expected, reader.read(sorted(expected.topics), tick))
        reports.append(report)
    return reports


def _checkable(states: list[SubscriberState], *, named: bool) -> list[SubscriberState]:
    """Records of the debezium format carry Debezium's headers only (no message id or
    position of the relay's), so verify cannot tell them apart: it says so."""
    debezium = [s.subscriber.name for s in states if s.subscriber.value_format == "debezium"]
    if debezium and named:
        raise SubscriberError(
            f"cannot verify {debezium}: the debezium format carries no relay headers"
        )
    for name in debezium:
        logger.warning(
            "not verified: subscriber %s (the debezium format carries no relay headers)", name
        )
    return [s for s in states if s.subscriber.name not in debezium]


def _expectations(
    conn: psycopg.Connection[Any], schema: str, state: SubscriberState
) -> tuple[SubscriberReport, _Expected]:
    subscriber = state.subscriber
    expected = _Expected()
    report = SubscriberReport(subscriber.name, [])
    params = {
        "name": subscriber.name,
        "aggregate_types": None
        if subscriber.aggregate_types is None
        else sorted(subscriber.aggregate_types),
        "event_types": None if subscriber.event_types is None else sorted(subscriber.event_types),
    }
    topic_cache: dict[tuple[str, str], str] = {}
    query = queries_for(schema)["published_events"]
    with wrap_errors(), conn.transaction(), conn.cursor(name="verify") as cursor:
        cursor.itersize = 10_000
        cursor.execute(query, params)
        for message_id, transaction_id, position, aggregate_type, event_type, dead in cursor:
            if dead:
                report.dead_lettered += 1
                continue
            pair = (aggregate_type, event_type)
            if pair not in topic_cache:
                topic_cache[pair] = subscriber.topic.format(
                    aggregate_type=aggregate_type, event_type=event_type
                )
            expected.topics.add(topic_cache[pair])
            expected.positions[message_id.bytes] = Position(transaction_id, position)
    with wrap_errors():
        starts = conn.execute(queries_for(schema)["part_starts"], {"name": subscriber.name})
        report.checked_after = [f"part {part} at {tx}:{pos}" for part, tx, pos in starts]
    report.expected = len(expected.positions)
    report.topics = sorted(expected.topics)
    return report, expected


def _compare(
    report: SubscriberReport, expected: _Expected, records: Iterable[ConsumedRecord]
) -> None:
    seen: set[bytes] = set()
    last_by_key: dict[tuple[str, int, bytes | None], Position] = {}
    for record in records:
        if record.message_id is None or record.position is None:
            continue  # not written by the relay
        try:
            mid = UUID(record.message_id).bytes
        except ValueError:
            continue
        # Order by the event's key in the database, not the one in its headers: after a
        # move to another xid space (docs/design.md) the database rebased its keys, and
        # records published before the move carry the old ones.
        at = expected.positions.get(mid)
        key = (record.topic, record.partition, record.key)
        previous = last_by_key.get(key)
        if at is not None and previous is not None and at <= previous:
            report.out_of_order += 1
            report.example(
                "out_of_order",
                f"{record.topic}[{record.partition}]@{record.offset} key {record.key!r}: "
                f"{at} after {previous}",
            )
        if at is not None:
            last_by_key[key] = at
        if mid not in expected.positions:
            report.ahead += 1
            continue
        if mid in seen:
            report.duplicated += 1
            report.example(
                "duplicated",
                f"{record.message_id} again at {record.topic}[{record.partition}]@{record.offset}",
            )
            continue
        seen.add(mid)
        report.found += 1
    for mid, position in expected.positions.items():
        if mid not in seen:
            report.missing += 1
            report.example("missing", f"{UUID(bytes=mid)} (position {position})")


class KafkaTopicReader:
    """Reads topics with confluent-kafka, read_committed, by partition assignment."""

    def __init__(self, config: dict[str, Any], *, timeout: float = 120.0, settle: float = 1.0):
        self._config = {
            **config,
            "group.id": "outbox-relay-verify",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50,
        }
        self._timeout = timeout
        self._settle = settle

    def read(
        self, topics: Sequence[str], progress: Callable[[int, int], None]
    ) -> Iterator[ConsumedRecord]:
        if not topics:
            return
        consumer = Consumer(self._config, logger=_client_log)
        try:
            yield from self._read(consumer, topics, progress)
        finally:
            consumer.close()

    def _read(
        self, consumer: Consumer, topics: Sequence[str], progress: Callable[[int, int], None]
    ) -> Iterator[ConsumedRecord]:
        ends = self._ends(consumer, topics)
        total = sum(end - start for start, end in ends.values())
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in ends.items()])
        done = 0
        deadline = time.monotonic() + self._timeout
        last_message = time.monotonic()
        while not self._finished(consumer, ends, last_message):
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"verify could not read {sorted(topics)} to their end within {self._timeout}s"
                )
            for msg in consumer.consume(1000, 0.2):
                error = msg.error()
                if error is not None:
                    failure = classify(error, f"reading {msg.topic()}", Stage.READ)
                    if isinstance(failure, ConsumerHiccup):  # the deadline bounds these
                        logger.warning("%s", failure)
                    elif failure is not None:
                        raise failure
                    continue
                last_message = time.monotonic()
                done += 1
                yield _consumed(msg)
            progress(done, total)

    def _finished(
        self,
        consumer: Consumer,
        ends: dict[tuple[str, int], tuple[int, int]],
        last_message: float,
    ) -> bool:
        if time.monotonic() - last_message < self._settle:
            return False
        positions = consumer.position([TopicPartition(t, p) for t, p in ends])
        return all(
            tp.offset >= ends[(tp.topic, tp.partition)][1]
            or (ends[(tp.topic, tp.partition)][0] == ends[(tp.topic, tp.partition)][1])
            for tp in positions
        )

    def _ends(
        self, consumer: Consumer, topics: Sequence[str]
    ) -> dict[tuple[str, int], tuple[int, int]]:
        try:
            metadata = consumer.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            raise BrokerUnavailable(f"cannot list topics: {exc}") from exc
        ends = {}
        for topic in topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None:
                continue  # nothing was ever published there: every event is missing
            for partition in info.partitions:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=self._timeout
                )
                ends[(topic, partition)] = (low, high)
        return ends


def _consumed(msg: Any) -> ConsumedRecord:
    headers = dict(msg.headers() or [])
    message_id = headers.get(HEADER_ID)
    tx, pos = headers.get(HEADER_TRANSACTION_ID), headers.get(HEADER_POSITION)
    position = Position(int(tx), int(pos)) if tx and pos else None
    return ConsumedRecord(
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        key=msg.key(),
        message_id=message_id.decode() if isinstance(message_id, bytes) else None,
        position=position,
    )
