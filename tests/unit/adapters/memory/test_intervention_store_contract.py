"""The interventions' store's contract (tests/contracts/intervention_store.py) held
against the in-memory one, over an in-memory store (the relay's side of it)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from uuid import UUID

import pytest

from relay.adapters.memory import InMemoryInterventions, InMemoryStore
from relay.core.model import OutboxEvent
from tests.contracts.intervention_store import InterventionStoreContract, Write


class InMemoryOutbox:
    """The in-memory store the relay's side runs on, and events committed to it (a
    definition's contract too: test_definition_store_contract.py)."""

    @pytest.fixture
    def relay(self) -> InMemoryStore:
        return InMemoryStore()

    @pytest.fixture
    def write(self, relay: InMemoryStore) -> Write:
        def write(aggregate_id: str, aggregate_type: str) -> UUID:
            event = OutboxEvent(
                transaction_id=0, position=0, message_id=uuid.uuid4(),
                aggregate_type=aggregate_type, aggregate_id=aggregate_id, aggregate_version=None,
                event_type="E", payload={"id": aggregate_id}, headers={},
                occurred_at=datetime.now(UTC),
            )  # fmt: skip
            return relay.append(event).message_id

        return write


class TestInMemoryInterventions(InMemoryOutbox, InterventionStoreContract):
    @pytest.fixture
    def store(self, relay: InMemoryStore) -> InMemoryInterventions:
        return InMemoryInterventions(relay)
