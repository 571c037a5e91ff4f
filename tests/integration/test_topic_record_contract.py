"""The topic record's contract (tests/contracts/topic_record.py) held against Postgres:
``outbox_topics`` (migration 0017), as the relay role, one outbox per schema."""

from __future__ import annotations

import itertools
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.core.ports import TopicOrigin, TopicRecord
from relay.core.subscribers import Subscriber
from relay.ops.roles import grant_roles
from tests.contracts.topic_record import Handles, NewRecord, TopicRecordContract
from tests.support import RELAY_ROLE, Roles

_schemas = itertools.count()


class TestPostgresTopicRecord(TopicRecordContract):
    @pytest.fixture
    def new_outbox(self, db: psycopg.Connection[Any], roles: Roles) -> Any:
        def make(adopting: bool = False) -> str:
            """A new outbox in a schema of its own, granted to the relay role; one that
            had published before migration 0017 when ``adopting``."""
            schema = f"outbox_{next(_schemas)}"
            migrations.migrate(db, schema, up_to=16)
            if adopting:
                OutboxStore(db, schema).add(Subscriber("s"))
            migrations.migrate(db, schema)
            grant_roles(db, schema, relay_role=RELAY_ROLE)
            return schema

        return make

    @pytest.fixture
    def new_record(self, new_outbox: Any, roles: Roles) -> NewRecord:
        def make(adopting: bool = False) -> TopicRecord:
            return _record(roles.relay_url, new_outbox(adopting))

        return make

    @pytest.fixture
    def handles(self, new_outbox: Any, roles: Roles) -> Handles:
        def on_one_outbox(n: int) -> list[TopicRecord]:
            schema = new_outbox()
            return [_record(roles.relay_url, schema) for _ in range(n)]

        return on_one_outbox


def _record(url: str, schema: str) -> TopicRecord:
    return PostgresTopicRecord(lambda: psycopg.connect(url, autocommit=True), schema)


def test_a_schema_before_migration_0017_keeps_no_record(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    """A rolling deploy: the relay runs on the older schema, and says it has no record
    (its new row topics then wait for the migration; existing ones flow, as before)."""
    migrations.migrate(db, "older", up_to=16)
    record = _record(database_url, "older")  # the owner: no grant names the table yet
    assert record.recorded() is None
    assert record.reserve("t", 10) is None
    assert record.row_topics() is None
    assert record.adoption_pending() is False
    record.record(["t"], TopicOrigin.DECLARED)  # nothing to record in: no error
