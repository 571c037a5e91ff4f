"""The daemon's store contract (tests/contracts/daemon_store.py) held against the
in-memory store."""

from __future__ import annotations

from uuid import UUID

import pytest

from relay.adapters.memory import InMemoryStore
from tests.contracts.daemon_store import DaemonStoreContract
from tests.contracts.store import Write, event


class TestInMemoryDaemonStore(DaemonStoreContract):
    @pytest.fixture
    def store(self) -> InMemoryStore:
        return InMemoryStore()

    @pytest.fixture
    def write(self, store: InMemoryStore) -> Write:
        def write(aggregate_id: str) -> UUID:
            return store.append(event(aggregate_id)).message_id

        return write
