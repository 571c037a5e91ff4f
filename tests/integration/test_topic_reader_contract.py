"""The topic reader port's contract (tests/contracts/topic_reader.py) held against the
Kafka reader on Apache Kafka, written by the transactional publisher."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.kafka import TopicCreator, TransactionalPublisher
from relay.ports import Publisher, TopicReader
from tests.contracts.publisher import take_over
from tests.contracts.topic_reader import TopicReaderContract


class TestKafkaTopicReader(TopicReaderContract):
    @pytest.fixture
    def topics(self, topic_prefix: str) -> list[str]:
        return [f"{topic_prefix}t0", f"{topic_prefix}t1"]

    @pytest.fixture
    def publisher(self, kafka_bootstrap: str, topic_prefix: str) -> Iterator[Publisher]:
        config = {"bootstrap.servers": kafka_bootstrap}
        opened: list[Publisher] = []

        def open_publisher() -> Publisher:
            publisher = TransactionalPublisher(
                config,
                TopicCreator(config),
                10.0,
                transactional_id=f"{topic_prefix}reader",
                group_prefix=f"{topic_prefix}reader",
                checkpoint_topic=f"{topic_prefix}checkpoints",
                consumer_config=config,
            )
            opened.append(publisher)
            return publisher

        yield take_over(open_publisher, "g").publisher
        for publisher in opened:
            publisher.close()

    @pytest.fixture
    def reader(self, kafka_bootstrap: str) -> TopicReader:
        from relay.topic_reader import KafkaTopicReader

        return KafkaTopicReader({"bootstrap.servers": kafka_bootstrap}, timeout=30.0)
