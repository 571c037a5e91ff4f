"""The store port's contract (tests/contracts/store.py) held against the in-memory store."""

from __future__ import annotations

from uuid import UUID

import pytest

from relay.adapters.memory import InMemoryStore
from tests.contracts.store import StoreContract, Write, event


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> InMemoryStore:
        return InMemoryStore()

    @pytest.fixture
    def session(self, store: InMemoryStore) -> UUID:
        return store.open_session("contract", 1, 60)  # only a session claims a part

    @pytest.fixture
    def write(self, store: InMemoryStore) -> Write:
        def write(aggregate_id: str) -> UUID:
            return store.append(event(aggregate_id)).message_id

        return write
