"""The publisher port's contract (tests/contracts/publisher.py) held against the
transactional publisher on Apache Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.contracts.publisher import OpenPublisher, PublisherContract, Read, kafka_publishers
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
