"""The topic reader port's contract (tests/contracts/topic_reader.py) held against the
Kafka reader on Apache Kafka, written by the transactional publisher."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.core.ports import Publisher, TopicReader
from tests.contracts.publisher import kafka_publishers, take_over
from tests.contracts.topic_reader import TopicReaderContract


class TestKafkaTopicReader(TopicReaderContract):
    @pytest.fixture
    def topics(self, topic_prefix: str) -> list[str]:
        return [f"{topic_prefix}t0", f"{topic_prefix}t1"]

    @pytest.fixture
    def publisher(self, kafka_bootstrap: str, topic_prefix: str) -> Iterator[Publisher]:
        with kafka_publishers(kafka_bootstrap, topic_prefix, "reader") as opener:
            yield take_over(opener, "g").publisher

    @pytest.fixture
    def reader(self, kafka_bootstrap: str) -> TopicReader:
        from relay.adapters.kafka.topic_reader import KafkaTopicReader

        return KafkaTopicReader({"bootstrap.servers": kafka_bootstrap}, timeout=30.0)
