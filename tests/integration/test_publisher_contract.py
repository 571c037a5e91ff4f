"""The publisher port's contract (tests/contracts/publisher.py) held against the
transactional publisher on Apache Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from relay.core.model import Position
from relay.core.ports import Batch
from relay.errors import PoisonRecordError, ProducerFenced
from tests.contracts.publisher import (
    OpenPublisher,
    PublisherContract,
    Read,
    kafka_publishers,
    record,
)
from tests.support import consume, keys


class TestTransactionalPublisher(PublisherContract):
    @pytest.fixture
    def topic(self, topic_prefix: str) -> str:
        return f"{topic_prefix}events"

    @pytest.fixture
    def open_publisher(self, kafka_bootstrap: str, topic_prefix: str) -> Iterator[OpenPublisher]:
        with kafka_publishers(kafka_bootstrap, topic_prefix, uuid.uuid4().hex) as opener:
            yield opener

    @pytest.fixture
    def read(self, kafka_bootstrap: str, topic: str) -> Read:
        def read(expected: int) -> list[str]:
            return keys(consume(kafka_bootstrap, [topic], expected))

        return read


class TestTurnTakingPublisher(TestTransactionalPublisher):
    """Two transactional producers of the part taking turns, as the relay opens them."""

    @pytest.fixture
    def open_publisher(self, kafka_bootstrap: str, topic_prefix: str) -> Iterator[OpenPublisher]:
        part = uuid.uuid4().hex
        with kafka_publishers(kafka_bootstrap, topic_prefix, part, producers=2) as opener:
            yield opener


def test_turns_keep_a_keys_order(kafka_bootstrap: str, topic_prefix: str) -> None:
    """One key's records, a transaction each, on two producers taking turns: the topic
    holds them in the order published."""
    topic = f"{topic_prefix}ordered"
    values = [str(n).encode() for n in range(8)]
    with kafka_publishers(kafka_bootstrap, topic_prefix, "p", producers=2) as open_publisher:
        publisher = open_publisher()
        publisher.recover("g")
        for n, value in enumerate(values):
            one = record(topic, 0)._replace(value=value)
            publisher.publish(Batch([one], Position(10 + n, 1), "g"))
    assert [r.value for r in consume(kafka_bootstrap, [topic], len(values))] == values


def test_a_new_owner_fences_both_producers(kafka_bootstrap: str, topic_prefix: str) -> None:
    """Taking the part over fences each of the old owner's producers: neither can
    commit again, so no earlier owner's transaction lands after the checkpoint read."""
    topic = f"{topic_prefix}fenced"
    with kafka_publishers(kafka_bootstrap, topic_prefix, "p", producers=2) as open_publisher:
        old = open_publisher()
        old.recover("g")
        old.publish(Batch([record(topic, 0)], Position(10, 1), "g"))  # the first producer
        new = open_publisher()
        assert new.recover("g") is not None
        for n in (1, 2):  # the second producer's turn, then the first's again
            with pytest.raises(ProducerFenced):
                old.publish(Batch([record(topic, n)], Position(10 + n, 1), "g"))
        new.publish(Batch([record(topic, 3)], Position(13, 1), "g"))
    assert sorted(keys(consume(kafka_bootstrap, [topic], 2, quiet=2.0))) == ["k0", "k3"]


def test_one_producer_fences_the_second_id_too(kafka_bootstrap: str, topic_prefix: str) -> None:
    """Going from two producers to one (``transaction_producers = 1``) is a rolling
    change: the new owner fences the old owner's second producer as well, so the
    transaction that producer would take next cannot commit behind the new owner."""
    topic = f"{topic_prefix}fenced"
    with (
        kafka_publishers(kafka_bootstrap, topic_prefix, "p", producers=2) as open_two,
        kafka_publishers(kafka_bootstrap, topic_prefix, "p", producers=1) as open_one,
    ):
        old = open_two()
        old.recover("g")
        old.publish(Batch([record(topic, 0)], Position(10, 1), "g"))  # the first producer
        new = open_one()
        assert new.recover("g") is not None
        with pytest.raises(ProducerFenced):  # the second producer's turn
            old.publish(Batch([record(topic, 1)], Position(11, 1), "g"))
        new.publish(Batch([record(topic, 2)], Position(12, 1), "g"))
    assert sorted(keys(consume(kafka_bootstrap, [topic], 2, quiet=2.0))) == ["k0", "k2"]


def test_the_record_the_broker_rejects_is_the_one_blamed(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Delivery reports carry no headers, so matching a rejection by the ``id`` header
    found nothing and blamed the batch's first record: another event was dead-lettered
    and the culprit retried for ever (found by the #31 speed work)."""
    topic = f"{topic_prefix}small"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created = admin.create_topics(
        [NewTopic(topic, num_partitions=1, config={"max.message.bytes": "2000"})]
    )
    created[topic].result(30)
    other = f"{topic_prefix}other"  # alone in its batch to the broker: the one rejected
    records = [record(other, 0), record(topic, 1)._replace(value=b"x" * 5000), record(other, 2)]
    with kafka_publishers(kafka_bootstrap, topic_prefix, uuid.uuid4().hex) as open_publisher:
        publisher = open_publisher()
        publisher.recover("g")
        with pytest.raises(PoisonRecordError) as refused:
            publisher.publish(Batch(records, Position(1, 3), "g"))
    assert refused.value.record is records[1]
    assert not refused.value.ambiguous


def test_a_peer_that_took_the_part_over_is_not_fenced_by_the_old_owner_s_retry(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """An old owner's transaction aborts (here a record too large; in CI's chaos test a
    broker's outage), and a peer takes its part over before the retry. The retry's new
    epoch fenced the peer and published again a batch the peer had committed: 50 events
    twice. Once the old owner's lease lapsed, it retries nothing."""
    topic = f"{topic_prefix}taken"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created = admin.create_topics(
        [NewTopic(topic, num_partitions=1, config={"max.message.bytes": "2000"})]
    )
    created[topic].result(30)
    too_large = record(topic, 9)._replace(value=b"x" * 5000)
    with kafka_publishers(kafka_bootstrap, topic_prefix, uuid.uuid4().hex) as open_publisher:
        old = open_publisher()
        old.recover("g")
        new = open_publisher()

        def lapsed() -> bool:  # asked once the old transaction aborted
            new.recover("g")  # meanwhile the old owner's session expired: a peer took over
            new.publish(Batch([record(topic, 0)], Position(10, 1), "g"))
            return False

        with pytest.raises(ProducerFenced, match="session lapsed"):
            old.publish(Batch([too_large], Position(10, 1), "g"), None, lapsed)
        new.publish(Batch([record(topic, 1)], Position(11, 1), "g"))  # not fenced
    assert keys(consume(kafka_bootstrap, [topic], 2, quiet=2.0)) == ["k0", "k1"]
