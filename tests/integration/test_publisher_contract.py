"""The publisher port's contract (tests/contracts/publisher.py) held against the
transactional publisher on Apache Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from relay.kafka import TopicCreator, TransactionalPublisher
from relay.ports import Publisher
from tests.contracts.publisher import OpenPublisher, PublisherContract, Read
from tests.support import consume, keys


class TestTransactionalPublisher(PublisherContract):
    @pytest.fixture
    def topic(self, topic_prefix: str) -> str:
        return f"{topic_prefix}events"

    @pytest.fixture
    def open_publisher(self, kafka_bootstrap: str, topic_prefix: str) -> Iterator[OpenPublisher]:
        config = {"bootstrap.servers": kafka_bootstrap}
        part = uuid.uuid4().hex
        opened: list[Publisher] = []

        def open_publisher() -> Publisher:
            publisher = TransactionalPublisher(
                config,
                TopicCreator(config),
                10.0,
                transactional_id=f"{topic_prefix}{part}",
                group_prefix=f"{topic_prefix}{part}",
                checkpoint_topic=f"{topic_prefix}checkpoints",
                consumer_config=config,
            )
            opened.append(publisher)
            return publisher

        yield open_publisher
        for publisher in opened:
            publisher.close()

    @pytest.fixture
    def read(self, kafka_bootstrap: str, topic: str) -> Read:
        def read(expected: int) -> list[str]:
            return keys(consume(kafka_bootstrap, [topic], expected))

        return read
