"""The replay ledger's and verify outbox's contracts (tests/contracts/replay_ledger.py)
held against the in-memory ones, over one in-memory store."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from uuid import UUID

import pytest

from relay.adapters.memory import InMemoryReplayLedger, InMemoryStore, InMemoryVerifyOutbox
from relay.core.model import OutboxEvent
from relay.core.ports import ReplayLedger, VerifyOutbox
from tests.contracts.replay_ledger import (
    Ledgers,
    Outboxes,
    ReplayLedgerContract,
    VerifyOutboxContract,
    Write,
)


@pytest.fixture
def store() -> InMemoryStore:
    return InMemoryStore()


@pytest.fixture
def write(store: InMemoryStore) -> Write:
    def write(aggregate_id: str, aggregate_type: str, event_type: str) -> UUID:
        event = OutboxEvent(
            transaction_id=0, position=0, message_id=uuid.uuid4(), aggregate_type=aggregate_type,
            aggregate_id=aggregate_id, aggregate_version=None, event_type=event_type,
            payload={"id": aggregate_id}, headers={}, occurred_at=datetime.now(UTC),
        )  # fmt: skip
        return store.append(event).message_id

    return write


class TestInMemoryReplayLedger(ReplayLedgerContract):
    @pytest.fixture
    def ledgers(self, store: InMemoryStore) -> Ledgers:
        def on_the_store(n: int) -> list[ReplayLedger]:
            return [InMemoryReplayLedger(store) for _ in range(n)]

        return on_the_store


class TestInMemoryVerifyOutbox(VerifyOutboxContract):
    @pytest.fixture
    def outboxes(self, store: InMemoryStore) -> Outboxes:
        def on_the_store(n: int) -> list[VerifyOutbox]:
            return [InMemoryVerifyOutbox(store) for _ in range(n)]

        return on_the_store
