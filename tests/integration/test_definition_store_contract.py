"""A definition's store's contract (tests/contracts/definition_store.py) held against
the Postgres store as the relay role, which `subscribers add`/`set` and a relay's
start-up run as (it may not build part indexes: ``index_parts`` says so and goes on)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from relay.core.model import Position
from tests.contracts.definition_store import DefinitionStoreContract, Force
from tests.integration.test_intervention_store_contract import PostgresOutbox


class TestPostgresDefinitions(PostgresOutbox, DefinitionStoreContract):
    @pytest.fixture
    def force(self, db: psycopg.Connection[Any]) -> Force:
        """As the owner: the test's deliberate tampering (no role may move a checkpoint
        beyond the horizon through the relay)."""

        def force(name: str, part: int, at: Position) -> None:
            db.execute(
                "UPDATE outbox_checkpoints SET transaction_id = %s::text::xid8, position = %s,"
                " updated_at = now() WHERE subscriber = %s AND part = %s",
                (at.transaction_id, at.position, name, part),
            )

        return force
