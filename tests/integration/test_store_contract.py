"""The store port's contract (tests/contracts/store.py) held against the Postgres store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.pool import RelayPool
from relay.adapters.postgres.store import OutboxStore
from tests.contracts.store import StoreContract, Write


class TestPostgresStore(StoreContract):
    @pytest.fixture
    def store(self, relay_db: psycopg.Connection[Any]) -> Iterator[OutboxStore]:
        yield OutboxStore(relay_db)  # the relay's store, as the relay role

    @pytest.fixture
    def session(self, store: OutboxStore) -> UUID:
        # Postgres lets live sessions only claim a part.
        return store.open_session("contract", 1, 60)

    @pytest.fixture
    def write(self, writer_db: psycopg.Connection[Any]) -> Write:
        outbox = Outbox(None)

        def write(aggregate_id: str) -> UUID:
            return outbox.append(
                writer_db, aggregate_type="order", aggregate_id=aggregate_id, event_type="Placed",
                payload={"id": aggregate_id},
            )  # fmt: skip

        return write


class TestPooledStore(TestPostgresStore):
    """The store a relay's parts share: every call on a connection borrowed from a
    pool of two (relay/adapters/postgres/pool.py)."""

    @pytest.fixture
    def store(self, db: psycopg.Connection[Any], database_url: str) -> Iterator[OutboxStore]:
        pool = RelayPool(database_url, max_size=2, keep_free=0)
        try:
            yield pool.store("public")
        finally:
            pool.close()
