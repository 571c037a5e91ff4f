"""The topic record's contract (tests/contracts/topic_record.py) held against the
in-memory record."""

from __future__ import annotations

import pytest

from relay.adapters.memory import InMemoryTopicRecord
from relay.core.ports import TopicRecord
from tests.contracts.topic_record import Handles, NewRecord, TopicRecordContract


class TestInMemoryTopicRecord(TopicRecordContract):
    @pytest.fixture
    def new_record(self) -> NewRecord:
        return lambda adopting=False: InMemoryTopicRecord(adopting=adopting)

    @pytest.fixture
    def handles(self) -> Handles:
        def on_one_outbox(n: int) -> list[TopicRecord]:
            record = InMemoryTopicRecord()
            return [record] * n

        return on_one_outbox
