"""Reading topics back: the Kafka adapter of :class:`relay.core.ports.TopicReader`.

Partitions are assigned, never subscribed: no group membership, no rebalance, no
committed offsets; every read starts at the beginning of the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from relay.adapters.kafka.client_logs import client_logger
from relay.adapters.kafka.kafka_errors import Stage, classify
from relay.core.log_fields import log_extra
from relay.core.model import ConsumedRecord
from relay.core.ports import Progress
from relay.errors import BrokerUnavailable, ConsumerHiccup

logger = logging.getLogger(__name__)
# librdkafka's own lines: deduplicated, at most one of a kind a minute.
_client_log = client_logger()

# How often follow() looks for topics that did not exist yet.
_LOOK_FOR_TOPICS_S = 0.5


class KafkaTopicReader:
    """Reads topics with confluent-kafka, by partition assignment.

    ``config`` is the client's (bootstrap servers, TLS, SASL...); ``isolation`` is
    read_committed unless a test means to see aborted transactions too. ``timeout``
    bounds a :meth:`read`; ``settle`` is how long it waits for stragglers at the end.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        timeout: float = 120.0,
        settle: float = 1.0,
        group: str = "outbox-relay-verify",
        isolation: str = "read_committed",
    ) -> None:
        self._config = {
            "fetch.wait.max.ms": 50,
            **config,
            "group.id": group,  # named only: offsets are never committed
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
        self._timeout = timeout
        self._settle = settle

    def read(
        self, topics: Sequence[str], progress: Progress | None = None
    ) -> Iterator[ConsumedRecord]:
        if not topics:
            return
        consumer = self._consumer()
        try:
            yield from self._read(consumer, topics, progress or _ignore)
        finally:
            consumer.close()

    def follow(
        self, topics: Sequence[str], idle: float = 0.1, *, from_beginning: bool = True
    ) -> Generator[ConsumedRecord | None, None, None]:
        consumer = self._consumer()
        try:
            waiting = list(topics)  # not assigned yet: they do not exist (yet)
            look_at = 0.0
            while True:
                if waiting and time.monotonic() >= look_at:
                    unassigned = self._assign_existing(consumer, waiting, from_beginning)
                    look_at = time.monotonic() + _LOOK_FOR_TOPICS_S
                    if unassigned is not None:  # a topic that appears later: all of it is new
                        waiting, from_beginning = unassigned, True
                message = consumer.poll(idle)
                if message is None:
                    yield None
                elif _readable(message):
                    yield consumed(message)
        finally:
            consumer.close()

    def _consumer(self) -> Consumer:
        try:
            return Consumer(self._config, logger=_client_log)
        except KafkaException as exc:
            raise classify(exc, "kafka: invalid consumer configuration", Stage.CONFIGURE) from exc

    def _assign_existing(
        self, consumer: Consumer, topics: list[str], from_beginning: bool = True
    ) -> list[str] | None:
        """Assign every partition of ``topics`` that exist, from the start (or from the
        end they have now, as a number: a record published once this returns is read);
        returns the others, or None when the topics could not be listed."""
        try:
            metadata = consumer.list_topics(timeout=2).topics
        except KafkaException as exc:
            logger.debug(
                "cannot list topics yet: %s",
                exc,
                extra=log_extra("kafka_topics_unlisted", error=exc),
            )
            return None
        waiting = []
        for topic in topics:
            info = metadata.get(topic)
            if info is None or info.error is not None or not info.partitions:
                waiting.append(topic)
                continue
            consumer.incremental_assign(
                [
                    TopicPartition(topic, p, self._start(consumer, topic, p, from_beginning))
                    for p in info.partitions
                ]
            )
        return waiting

    def _start(self, consumer: Consumer, topic: str, partition: int, from_beginning: bool) -> int:
        """Where a follower starts reading a partition: its beginning, or its end now."""
        if from_beginning:
            return OFFSET_BEGINNING
        return self._watermarks(consumer, topic, partition)[1]

    def _read(
        self, consumer: Consumer, topics: Sequence[str], progress: Progress
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
                    f"could not read {sorted(topics)} to their end within {self._timeout}s"
                )
            for message in consumer.consume(1000, 0.2):
                if _readable(message):
                    last_message = time.monotonic()
                    done += 1
                    yield consumed(message)
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
        self, consumer: Consumer, topics: Iterable[str]
    ) -> dict[tuple[str, int], tuple[int, int]]:
        try:
            metadata = consumer.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            raise classify(exc, "cannot list topics") from exc
        ends = {}
        for topic in topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None:
                continue  # nothing was ever published there
            for partition in info.partitions:
                ends[(topic, partition)] = self._watermarks(consumer, topic, partition)
        return ends

    def _watermarks(self, consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
        """The partition's low and high offsets. A retriable error (no leader yet, or
        another: a topic just created, a leader moving) is asked again until the
        reader's timeout; then it is classified, as any other error at once."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=self._timeout
                )
                return low, high
            except KafkaException as exc:
                if not _passing(exc) or time.monotonic() >= deadline:
                    raise classify(exc, f"reading {topic}[{partition}]'s offsets") from exc
                time.sleep(0.2)


# Errors of a partition whose leadership is settling (a topic just created, a leader
# moving): librdkafka flags some of them retriable, not all (NOT_LEADER_FOR_PARTITION
# comes back from a watermark query unflagged).
_SETTLING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)


def _passing(exc: KafkaException) -> bool:
    """Whether the watermark query's error passes by itself (asked again)."""
    error = exc.args[0] if exc.args else None
    if not isinstance(error, KafkaError):
        return False
    return bool(error.retriable()) or error.code() in _SETTLING


def _readable(message: Any) -> bool:
    """Whether ``message`` is a record; raises when its error ends the reading."""
    error = message.error()
    if error is None:
        return True
    failure = classify(error, f"reading {message.topic()}", Stage.READ)
    if isinstance(failure, ConsumerHiccup):  # the caller's deadline bounds these
        logger.warning(
            "%s", failure, extra=log_extra("kafka_consumer_hiccup", topic=message.topic())
        )
    elif failure is not None:
        try:
            raise failure
        finally:
            del failure  # raised, it holds this frame: no cycle through it (#53)
    return False


def consumed(message: Any) -> ConsumedRecord:
    """The record a confluent-kafka message carries."""
    kind, timestamp = message.timestamp()
    return ConsumedRecord(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        key=message.key(),
        value=message.value(),
        headers=list(message.headers() or []),
        timestamp_ms=None if kind == TIMESTAMP_NOT_AVAILABLE else timestamp,
    )


def _ignore(done: int, total: int) -> None:
    pass
