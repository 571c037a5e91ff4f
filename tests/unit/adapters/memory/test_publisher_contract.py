"""The publisher port's contract (tests/contracts/publisher.py) held against the in-memory
publisher."""

from __future__ import annotations

import pytest

from relay.adapters.memory import InMemoryPublisher
from tests.contracts.publisher import OpenPublisher, PublisherContract, Read


class TestInMemoryPublisher(PublisherContract):
    @pytest.fixture
    def broker(self) -> InMemoryPublisher:
        return InMemoryPublisher()

    @pytest.fixture
    def open_publisher(self, broker: InMemoryPublisher) -> OpenPublisher:
        # Its state is the broker's: every owner of the part sees the same one.
        return lambda: broker

    @pytest.fixture
    def topic(self) -> str:
        return "t"

    @pytest.fixture
    def read(self, broker: InMemoryPublisher, topic: str) -> Read:
        def read(expected: int) -> list[str]:
            keys = [(r.key or b"").decode() for r in broker.published() if r.topic == topic]
            assert len(keys) == expected
            return keys

        return read
