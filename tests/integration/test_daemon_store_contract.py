"""The daemon's store contract (tests/contracts/daemon_store.py) held against the
Postgres store, as the relay role: on a connection of its own, and pooled as the
daemon holds it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.pool import RelayPool
from relay.adapters.postgres.store import OutboxStore
from tests.contracts.daemon_store import DaemonStoreContract
from tests.contracts.store import Write


class TestPostgresDaemonStore(DaemonStoreContract):
    @pytest.fixture
    def store(self, relay_db: psycopg.Connection[Any]) -> Iterator[OutboxStore]:
        yield OutboxStore(relay_db)

    @pytest.fixture
    def write(self, writer_db: psycopg.Connection[Any]) -> Write:
        outbox = Outbox(None)

        def write(aggregate_id: str) -> UUID:
            return outbox.append(
                writer_db, aggregate_type="order", aggregate_id=aggregate_id, event_type="Placed",
                payload={"id": aggregate_id},
            )  # fmt: skip

        return write


class TestPooledDaemonStore(TestPostgresDaemonStore):
    """The store the daemon holds: every call on a connection borrowed from its pool."""

    @pytest.fixture
    def store(self, relay_url: str) -> Iterator[OutboxStore]:
        pool = RelayPool(relay_url, max_size=2, keep_free=0)
        try:
            yield pool.store("public")
        finally:
            pool.close()
