"""The publisher port's contract (``relay.core.ports.Publisher``): what a part worker relies
on of Kafka, held against the transactional publisher on Apache Kafka and against the
in-memory one, so tests of the worker's logic over the in-memory one say something
about the real one. ``tests/unit/adapters/memory/test_publisher_contract.py`` and
``tests/integration/test_publisher_contract.py`` subclass it once per adapter."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple
from uuid import UUID

import pytest

from relay.adapters.kafka.call_thread import CallThread
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups
from relay.adapters.kafka.kafka import TopicCreator, TransactionalPublisher
from relay.adapters.kafka.turns import part_publisher
from relay.core.model import KafkaCheckpoint, KafkaRecord, Position
from relay.core.ports import Batch, Extension, Publisher
from relay.errors import BrokerUnavailable

SPACE = uuid.uuid4()

# A producer for the part under test: each call stands for a new owner of the part.
OpenPublisher = Callable[[], Publisher]


class TakenOver(NamedTuple):
    publisher: Publisher
    checkpoint: KafkaCheckpoint | None


# The keys of the records committed to the topic, once ``expected`` of them arrived.
Read = Callable[[int], list[str]]


class PublisherContract:
    """Subclassed once per adapter, with ``open_publisher``, ``topic`` and ``read``."""

    @pytest.fixture
    def generation(self) -> str:
        return str(uuid.uuid4())

    def test_a_part_never_published_has_no_kafka_side_checkpoint(
        self, open_publisher: OpenPublisher, generation: str
    ) -> None:
        assert take_over(open_publisher, generation).checkpoint is None

    def test_a_published_batch_leaves_its_checkpoint_to_the_next_owner(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        first = take_over(open_publisher, generation).publisher
        records = [record(topic, n) for n in range(3)]
        first.publish(Batch(records, Position(10, 3), generation))
        assert take_over(open_publisher, generation).checkpoint == KafkaCheckpoint(
            Position(10, 3), SPACE, message_of(records[-1])
        )
        assert sorted(read(3)) == ["k0", "k1", "k2"]

    def test_a_batchs_dead_letters_leave_with_its_checkpoint_thousands_of_them(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        """Issue #47: the checkpoint names a transaction's dead letters by key, within the
        broker's offset.metadata.max.bytes (4 KiB), a batch_size's worth of them: the
        next owner that adopts it reads every one back."""
        letters = [(Position(10, 3 + 3 * n + n % 2), "dlq") for n in range(5000)]
        first = take_over(open_publisher, generation).publisher
        records = [record(topic, 0)]
        first.publish(Batch(records, Position(10, 20_000), generation, dead_letters=letters))
        checkpoint = take_over(open_publisher, generation).checkpoint
        assert checkpoint is not None and checkpoint.position == Position(10, 20_000)
        assert checkpoint.dead_letters == tuple(letters)
        assert read(1) == ["k0"]

    def test_an_extension_joins_the_transaction_and_moves_its_end(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        publisher = take_over(open_publisher, generation).publisher
        extension = [record(topic, n) for n in (1, 2)]

        def meanwhile() -> Extension | None:
            return extension, Position(20, 2)

        publisher.publish(Batch([record(topic, 0)], Position(10, 1), generation), meanwhile)
        assert take_over(open_publisher, generation).checkpoint == KafkaCheckpoint(
            Position(20, 2), SPACE, message_of(extension[-1])
        )
        assert sorted(read(3)) == ["k0", "k1", "k2"]

    def test_no_extension_leaves_the_batch_as_it_was(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        publisher = take_over(open_publisher, generation).publisher
        publisher.publish(Batch([record(topic, 0)], Position(10, 1), generation), lambda: None)
        checkpoint = take_over(open_publisher, generation).checkpoint
        assert checkpoint is not None and checkpoint.position == Position(10, 1)
        assert read(1) == ["k0"]

    def test_a_batch_that_may_not_grow_commits_as_given_and_runs_meanwhile_once(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        """A full batch: the next one is read while it commits (may_extend=False)."""
        publisher = take_over(open_publisher, generation).publisher
        calls: list[int] = []

        def meanwhile() -> Extension | None:
            calls.append(1)
            return None

        records = [record(topic, n) for n in range(2)]
        publisher.publish(Batch(records, Position(10, 2), generation, may_extend=False), meanwhile)
        assert calls == [1]
        assert take_over(open_publisher, generation).checkpoint == KafkaCheckpoint(
            Position(10, 2), SPACE, message_of(records[-1])
        )
        assert sorted(read(2)) == ["k0", "k1"]

    def test_a_failure_while_the_batch_commits_does_not_undo_the_commit(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        """Reading the next batch failed (Postgres went away, say) while this one
        committed: the error reaches the caller, and recovery finds the batch committed."""
        publisher = take_over(open_publisher, generation).publisher

        def meanwhile() -> Extension | None:
            raise BrokerUnavailable("the next batch could not be read")

        with pytest.raises(BrokerUnavailable, match="next batch"):
            publisher.publish(
                Batch([record(topic, 0)], Position(10, 1), generation, may_extend=False), meanwhile
            )
        checkpoint = take_over(open_publisher, generation).checkpoint
        assert checkpoint is not None and checkpoint.position == Position(10, 1)
        assert read(1) == ["k0"]

    def test_a_checkpoint_belongs_to_its_generation(
        self, open_publisher: OpenPublisher, topic: str, generation: str
    ) -> None:
        """A reset starts a new generation: the old one's progress is not the new one's."""
        publisher = take_over(open_publisher, generation).publisher
        publisher.publish(Batch([record(topic, 0)], Position(10, 1), generation))
        assert take_over(open_publisher, str(uuid.uuid4())).checkpoint is None

    def test_batches_in_a_row_leave_the_last_ones_checkpoint(
        self, open_publisher: OpenPublisher, topic: str, read: Read, generation: str
    ) -> None:
        """A part publishing back to back: every batch once, the last one's checkpoint
        (two producers taking turns commit it alternately to one group)."""
        publisher = take_over(open_publisher, generation).publisher
        records = [record(topic, n) for n in range(5)]
        for n, one in enumerate(records):
            publisher.publish(Batch([one], Position(10 + n, 1), generation))
        assert take_over(open_publisher, generation).checkpoint == KafkaCheckpoint(
            Position(14, 1), SPACE, message_of(records[-1])
        )
        assert sorted(read(5)) == [f"k{n}" for n in range(5)]

    def test_a_batch_of_nothing_leaves_the_kafka_side_checkpoint_alone(
        self, open_publisher: OpenPublisher, topic: str, generation: str
    ) -> None:
        """Every event of the batch was filtered out: only the Postgres checkpoint moves."""
        publisher = take_over(open_publisher, generation).publisher
        publisher.publish(Batch([record(topic, 0)], Position(10, 1), generation))
        publisher.publish(Batch([], Position(30, 1), generation))
        checkpoint = take_over(open_publisher, generation).checkpoint
        assert checkpoint is not None and checkpoint.position == Position(10, 1)


def take_over(open_publisher: OpenPublisher, generation: str) -> TakenOver:
    """Take the part over as the worker does: with a new producer after a failure
    (a fresh broker's transaction coordinator may still be loading)."""
    for attempt in range(1, 11):
        publisher = open_publisher()
        try:
            return TakenOver(publisher, publisher.recover(generation, SPACE))
        except BrokerUnavailable:
            if attempt == 10:
                raise
            publisher.close()
            time.sleep(1)
    raise AssertionError("unreachable")


def record(topic: str, n: int) -> KafkaRecord:
    """A record as the encoder makes it: the message id in the ``id`` header."""
    return KafkaRecord(topic, f"k{n}".encode(), b"{}", [("id", str(uuid.uuid4()).encode())])


def message_of(record: KafkaRecord) -> UUID:
    assert record.outbox_message_id is not None
    return UUID(record.outbox_message_id)


@contextmanager
def kafka_publishers(
    bootstrap: str, prefix: str, part: str, *, producers: int = 1
) -> Iterator[OpenPublisher]:
    """Opens transactional publishers of one part on Apache Kafka, each a new owner of
    it (with ``producers=2``, two taking turns, as the relay opens them); closes them
    all on exit."""
    config = {"bootstrap.servers": bootstrap}
    opened: list[Publisher] = []
    groups = CheckpointGroups(config)  # one, as a relay's publishers share

    def open_producer(transactional_id: str, calls: CallThread) -> TransactionalPublisher:
        return TransactionalPublisher(
            config,
            TopicCreator(config),
            10.0,
            transactional_id=transactional_id,
            transaction_timeout_s=10.0,
            group_prefix=f"{prefix}{part}",
            checkpoint_topic=f"{prefix}checkpoints",
            groups=groups,
            calls=calls,
        )

    def open_publisher() -> Publisher:
        calls = CallThread("kafka-txn-call")  # one for a part's producers, as the relay's

        def opened_on_calls(transactional_id: str) -> TransactionalPublisher:
            return open_producer(transactional_id, calls)

        publisher = part_publisher(opened_on_calls, f"{prefix}{part}", producers)
        opened.append(publisher)
        return publisher

    try:
        yield open_publisher
    finally:
        for publisher in opened:
            publisher.close()
