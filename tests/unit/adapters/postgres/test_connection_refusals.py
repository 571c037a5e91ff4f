"""Why Postgres refused a connection, and the remedy the relay logs for it
(relay/adapters/postgres/db.py, ``refusal``): issue #49 saw "raise max_connections"
logged for a standby during a failover, a partition and a wrong password alike. The
texts are libpq's and the server's own, as psycopg raises them at connect time (with no
SQLSTATE); the codes are those a query gets."""

from __future__ import annotations

import logging

import psycopg
import pytest
from psycopg import errors as pg_errors

from relay.adapters.postgres.db import refusal
from relay.adapters.postgres.pool import _Refusals

HOST = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '
DOWN = (
    'connection to server at "10.0.0.4", port 5432 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?\n"
)


@pytest.mark.parametrize(
    ("error", "cause", "remedy"),
    [
        (HOST + "FATAL:  sorry, too many clients already", "too_many_clients", "max_connections"),
        (HOST + 'FATAL:  too many connections for role "outbox_relay"', "too_many_clients",
         "CONNECTION LIMIT"),
        (HOST + "FATAL:  remaining connection slots are reserved for non-replication "
         "superuser connections", "too_many_clients", "max_db_connections"),
        (HOST + 'FATAL:  password authentication failed for user "outbox_relay"',
         "authentication", "password in database_url"),
        (HOST + "fe_sendauth: no password supplied", "authentication", "PGPASSWORD"),
        (HOST + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "outbox_relay"',
         "authentication", "pg_hba.conf"),
        # A multi-host URL during a failover: the old primary down, the other a standby.
        (DOWN + HOST + "session is read-only", "read_only", "target_session_attrs"),
        (HOST + "server is in hot standby mode", "read_only", "failover"),
        (HOST + "timeout expired", "unreachable", "hosts and ports"),
        (DOWN, "unreachable", "reconnects"),
        ('could not translate host name "db" to address: Name or service not known',
         "unreachable", "database_url"),
        (HOST + "FATAL:  the database system is starting up", "unreachable", "restarting"),
        (HOST + 'FATAL:  database "app" does not exist', "login", "Create the database"),
        (HOST + "FATAL:  the moon is in the wrong phase", "other", "server's log"),
    ],
    ids=["too many clients", "role's limit", "reserved slots", "wrong password",
         "no password", "pg_hba", "failover to a standby", "hot standby", "timeout",
         "refused", "unknown host", "starting up", "no database", "other"],
)  # fmt: skip
def test_a_refused_connection_is_told_by_its_cause(error: str, cause: str, remedy: str) -> None:
    found = refusal(psycopg.OperationalError(error))
    assert found.cause == cause
    assert remedy in found.remedy
    if cause != "too_many_clients":
        assert "max_connections" not in found.remedy


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (pg_errors.TooManyConnections, "too_many_clients"),
        (pg_errors.InvalidPassword, "authentication"),
        (pg_errors.InvalidAuthorizationSpecification, "authentication"),
        (pg_errors.ReadOnlySqlTransaction, "read_only"),
        (pg_errors.CannotConnectNow, "unreachable"),
    ],
)
def test_a_sqlstate_settles_the_cause_whatever_the_words(
    error: type[psycopg.Error], cause: str
) -> None:
    assert refusal(error("in the server's language")).cause == cause


def test_a_refusal_is_told_again_when_its_cause_changes(caplog: pytest.LogCaptureFixture) -> None:
    # A failover: the primary stops answering, then the multi-host URL finds a standby.
    caplog.set_level(logging.INFO, logger="relay.adapters.postgres.pool")
    refusals = _Refusals()
    for error in (DOWN, DOWN, DOWN + HOST + "session is read-only", HOST + "session is read-only"):
        refusals.refused(error, refusal(psycopg.OperationalError(error)))
    refusals.accepted()
    told = [r for r in caplog.records if r.name == "relay.adapters.postgres.pool"]
    assert [r.levelname for r in told] == ["WARNING", "WARNING", "INFO"]
    assert [getattr(r, "cause", None) for r in told[:2]] == ["unreachable", "read_only"]
    assert all("max_connections" not in r.getMessage() for r in told)
