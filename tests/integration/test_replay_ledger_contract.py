"""The replay ledger's and verify outbox's contracts (tests/contracts/replay_ledger.py)
held against the Postgres queries, as the command line runs them: the store and the
ledger as the owner, each ledger on a connection of its own (the replay lock is a
session's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from uuid import UUID

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.replay_store import ReplayStore
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.verify_queries import PostgresVerifyOutbox
from relay.core.ports import ReplayLedger, VerifyOutbox
from tests.contracts.replay_ledger import (
    Ledgers,
    Outboxes,
    ReplayLedgerContract,
    VerifyOutboxContract,
    Write,
)


@pytest.fixture
def store(db: psycopg.Connection[Any]) -> OutboxStore:
    return OutboxStore(db)


@pytest.fixture
def write(writer_db: psycopg.Connection[Any]) -> Write:
    outbox = Outbox(None)

    def write(aggregate_id: str, aggregate_type: str, event_type: str) -> UUID:
        return outbox.append(
            writer_db, aggregate_type=aggregate_type, aggregate_id=aggregate_id,
            event_type=event_type, payload={"id": aggregate_id},
        )  # fmt: skip

    return write


@pytest.fixture
def connections(database_url: str) -> Iterator[ExitStack]:
    with ExitStack() as opened:
        yield opened


def _connect(database_url: str, opened: ExitStack) -> psycopg.Connection[Any]:
    return opened.enter_context(psycopg.connect(database_url, autocommit=True))


class TestPostgresReplayLedger(ReplayLedgerContract):
    @pytest.fixture
    def ledgers(self, database_url: str, connections: ExitStack) -> Ledgers:
        def on_the_outbox(n: int) -> list[ReplayLedger]:
            return [ReplayStore(_connect(database_url, connections)) for _ in range(n)]

        return on_the_outbox


class TestPostgresVerifyOutbox(VerifyOutboxContract):
    @pytest.fixture
    def outboxes(self, database_url: str, connections: ExitStack) -> Outboxes:
        def on_the_outbox(n: int) -> list[VerifyOutbox]:
            return [PostgresVerifyOutbox(_connect(database_url, connections)) for _ in range(n)]

        return on_the_outbox
