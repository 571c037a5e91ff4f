"""The relay's pool names why Postgres refused it a connection, with that cause's remedy
(issue #49: "raise max_connections" was logged for a wrong password too). A real server
refuses the relay role: once for a wrong password, once for its CONNECTION LIMIT (the
`grant --connection-limit` cap), which Postgres refuses as too many clients."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.pool import RelayPool
from relay.errors import DatabaseUnavailable
from tests.support import RELAY_ROLE, ROLE_PASSWORD, Roles, as_role, wait_until


def _refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "db_connection_refused"]


def _told(url: str, accepted_url: str, caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """The pool's WARNING once it has tried ``url`` (it retries in the background),
    after a connection to ``accepted_url``: refusals are told once per process until
    one is accepted, and an earlier test's may still stand."""
    accepted = RelayPool(accepted_url, max_size=1, keep_free=0)
    try:
        with accepted.connection():
            pass
    finally:
        accepted.close()
    caplog.set_level(logging.WARNING, logger="relay.adapters.postgres.pool")
    pool = RelayPool(url, max_size=1, keep_free=0)
    try:
        wait_until(lambda: bool(_refusals(caplog)), what="the pool to try a connection")
    finally:
        pool.close()
    return _refusals(caplog)[0]


@pytest.fixture
def no_relay_connections(roles: Roles, db: psycopg.Connection[Any]) -> Iterator[str]:
    """The relay role capped at no connection at all; its URL."""
    limit = sql.SQL("ALTER ROLE {} CONNECTION LIMIT {}")
    db.execute(limit.format(sql.Identifier(RELAY_ROLE), sql.Literal(0)))
    try:
        yield roles.relay_url
    finally:
        db.execute(limit.format(sql.Identifier(RELAY_ROLE), sql.Literal(-1)))


def test_a_wrong_password_is_told_to_fix_the_password(
    roles: Roles, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = as_role(roles.owner_url, RELAY_ROLE, "not-" + ROLE_PASSWORD)
    told = _told(wrong, roles.relay_url, caplog)
    assert "password authentication failed" in told.getMessage()
    assert "max_connections" not in told.getMessage()
    assert "fix the user or password" in told.getMessage()
    assert told.cause == "authentication"  # type: ignore[attr-defined]


def test_too_many_clients_is_told_to_raise_the_limits(
    roles: Roles, no_relay_connections: str, caplog: pytest.LogCaptureFixture
) -> None:
    told = _told(no_relay_connections, roles.owner_url, caplog)
    assert "too many connections for role" in told.getMessage()
    assert "CONNECTION LIMIT" in told.getMessage()
    assert told.cause == "too_many_clients"  # type: ignore[attr-defined]


def test_a_connection_to_a_read_only_server_is_retried_on_a_new_one(roles: Roles) -> None:
    """A write refused as read-only (a standby, during a failover) is an outage to retry,
    not a fault of the part, and the pool does not lend that connection again: the next
    borrow reaches the server that takes writes (here, the same server, once the
    session's read-only setting, which plays the standby, is gone with it)."""
    pool = RelayPool(roles.relay_url, max_size=1, keep_free=0)
    try:
        with pool.connection() as conn:
            conn.execute("SET default_transaction_read_only = on")
        with pytest.raises(DatabaseUnavailable), pool.connection() as conn, wrap_errors():
            conn.execute("CREATE TEMP TABLE written (n int)")
        with pool.connection() as conn:
            conn.execute("CREATE TEMP TABLE written (n int)")
    finally:
        pool.close()
