"""The topic reader port's contract (tests/contracts/topic_reader.py) held against the
in-memory reader of the in-memory publisher."""

from __future__ import annotations

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryTopicReader
from relay.core.ports import Publisher, TopicReader
from tests.contracts.topic_reader import TopicReaderContract, refuse_oversized


class TestInMemoryTopicReader(TopicReaderContract):
    @pytest.fixture
    def broker(self) -> InMemoryPublisher:
        broker = InMemoryPublisher()
        broker.refuse = refuse_oversized  # as Kafka does, by message.max.bytes
        return broker

    @pytest.fixture
    def publisher(self, broker: InMemoryPublisher) -> Publisher:
        return broker

    @pytest.fixture
    def reader(self, broker: InMemoryPublisher) -> TopicReader:
        return InMemoryTopicReader(broker)

    @pytest.fixture
    def topics(self) -> list[str]:
        return ["t0", "t1"]
