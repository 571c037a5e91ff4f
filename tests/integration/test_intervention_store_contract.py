"""The interventions' store's contract (tests/contracts/intervention_store.py) held
against the Postgres store as the relay role, which the command line runs as; it is the
relay's side too (claims, advances, halts)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from tests.contracts.intervention_store import InterventionStoreContract, Write


class PostgresOutbox:
    """The store as the relay role, and events as the writer role writes them (a
    definition's contract too: tests/integration/test_definition_store_contract.py)."""

    @pytest.fixture
    def store(self, relay_db: psycopg.Connection[Any]) -> OutboxStore:
        return OutboxStore(relay_db)

    @pytest.fixture
    def relay(self, store: OutboxStore) -> OutboxStore:
        return store

    @pytest.fixture
    def write(self, writer_db: psycopg.Connection[Any]) -> Write:
        outbox = Outbox(None)

        def write(aggregate_id: str, aggregate_type: str) -> UUID:
            return outbox.append(
                writer_db, aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                event_type="E", payload={"id": aggregate_id},
            )  # fmt: skip

        return write


class TestPostgresInterventions(PostgresOutbox, InterventionStoreContract):
    pass
