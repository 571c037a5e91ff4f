"""The relay daemon's connections carry the session timeouts of its settings."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.adapters.postgres.db import wrap_errors
from relay.core.settings import load_settings
from relay.errors import RetryableError
from relay.wiring import connect_daemon


def test_daemon_connections_set_the_session_timeouts(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    settings = load_settings(
        database_url=database_url,
        database_statement_timeout=30,
        database_lock_timeout=0.25,
        database_idle_in_transaction_timeout=45,
    )
    with connect_daemon(settings) as conn:
        shown = [
            conn.execute(f"SHOW {name}").fetchone()
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
        ]
    assert shown == [("30s",), ("250ms",), ("45s",)]
    defaults = load_settings(database_url=database_url)
    with connect_daemon(defaults) as conn:
        assert conn.execute("SHOW lock_timeout").fetchone() == ("10s",)


def test_a_locked_outbox_is_a_retryable_error_not_a_wait(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    """The relay's query gives up on a lock after database_lock_timeout, and the error
    is one its callers retry (a worker would halt its part on any other)."""
    settings = load_settings(database_url=database_url, database_lock_timeout=0.25)
    with connect_daemon(settings) as conn, psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(RetryableError, match="lock timeout"), wrap_errors():
            conn.execute("SELECT count(*) FROM public.outbox")
        locker.rollback()


def test_pooled_connections_set_the_session_timeouts_too(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    """Every part, the probe and the session keeper borrow from the pool (relay/adapters/postgres/pool.py)."""
    from relay.adapters.postgres.pool import RelayPool
    from relay.wiring import session_timeouts

    settings = load_settings(database_url=database_url, database_lock_timeout=0.25)
    pool = RelayPool(database_url, max_size=1, keep_free=0, timeouts=session_timeouts(settings))
    try:
        with pool.connection() as conn:
            assert conn.execute("SHOW lock_timeout").fetchone() == ("250ms",)
    finally:
        pool.close()


def test_the_daemon_reads_occurred_at_in_utc_whatever_the_servers_zone(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], relay_url: str
) -> None:
    """A server in a local zone: the daemon's fetch, pooled or not, still loads each
    event's occurred_at as UTC (the cheap zone to load and subtract; the same instant),
    and so renders it with +00:00 (a routed occurred_at, a dead letter)."""
    from relay.adapters.postgres.pool import RelayPool
    from relay.adapters.postgres.store import OutboxStore
    from relay.core.model import Position
    from relay.core.ports import Selection
    from relay.wiring import session_timeouts

    database = db.execute("SELECT current_database()").fetchone()
    assert database is not None
    db.execute(sql.SQL("ALTER DATABASE {} SET TimeZone = 'Europe/Berlin'").format(
        sql.Identifier(database[0])))  # fmt: skip
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)"
        " VALUES ('Order', 'o-1', 'OrderPlaced', '{}', '2026-07-01 12:00:00+00')"
    )
    written = datetime(2026, 7, 1, 12, tzinfo=UTC)
    settings = load_settings(database_url=relay_url)
    with psycopg.connect(relay_url) as plain:  # what the server's zone gives a session
        assert plain.execute("SHOW TimeZone").fetchone() == ("Europe/Berlin",)
    pool = RelayPool(relay_url, max_size=1, keep_free=0, timeouts=session_timeouts(settings))
    try:
        with connect_daemon(settings) as conn, pool.connection() as pooled:
            for connection in (conn, pooled):
                fetched = OutboxStore(connection).fetch(Position(0, 0), Selection(limit=10))
                occurred_at = fetched.events[0].occurred_at
                assert occurred_at == written
                assert occurred_at.tzinfo is UTC
                assert occurred_at.isoformat() == "2026-07-01T12:00:00+00:00"
    finally:
        pool.close()
