"""The store port's contract (tests/contracts/store.py) held against the in-memory store."""

from __future__ import annotations

import uuid
from uuid import UUID

import pytest

from relay.testing import InMemoryStore
from tests.contracts.store import StoreContract, Write, event


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> InMemoryStore:
        return InMemoryStore()

    @pytest.fixture
    def session(self) -> UUID:
        return uuid.uuid4()

    @pytest.fixture
    def write(self, store: InMemoryStore) -> Write:
        def write(aggregate_id: str) -> UUID:
            return store.append(event(aggregate_id)).message_id

        return write
