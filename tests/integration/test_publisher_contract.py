"""The publisher port's contract (tests/contracts/publisher.py) held against the
transactional publisher on Apache Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from relay.core.model import Position
from relay.core.ports import Batch
from relay.errors import PoisonRecordError
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
