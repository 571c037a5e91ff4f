"""A definition's store's contract (tests/contracts/definition_store.py) held against
the in-memory one, over an in-memory store (the relay's side of it)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from relay.adapters.memory import InMemoryDefinitions, InMemoryStore
from relay.core.model import Position
from tests.contracts.definition_store import DefinitionStoreContract, Force
from tests.unit.adapters.memory.test_intervention_store_contract import InMemoryOutbox


class TestInMemoryDefinitions(InMemoryOutbox, DefinitionStoreContract):
    @pytest.fixture
    def store(self, relay: InMemoryStore) -> InMemoryDefinitions:
        return InMemoryDefinitions(relay)

    @pytest.fixture
    def force(self, relay: InMemoryStore) -> Force:
        def force(name: str, part: int, at: Position) -> None:
            state = relay.get_part(name, part)
            moved = dataclasses.replace(state, checkpoint=at, updated_at=datetime.now(UTC))
            relay.parts[name, part] = moved

        return force
