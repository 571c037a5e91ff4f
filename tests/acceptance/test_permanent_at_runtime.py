"""Issue #28: a permanent database error while the relay runs (a grant revoked) is
retried, but /readyz and the log say it is permanent and name the fix, instead of
"Postgres unreachable?"."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.core.settings import load_settings
from relay.daemon import Relay
from tests.support import http_get, login_url, run_cli, sub, wait_until


def test_a_revoked_grant_is_reported_as_permanent_by_readyz_and_the_log(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    role = f"relay_{uuid.uuid4().hex[:6]}"
    env = {"RELAY_DATABASE_URL": database_url}
    granted = run_cli("grant", "--relay-role", role, "--create", env=env)
    assert granted.returncode == 0, granted.stderr
    relay = Relay(
        load_settings(
            database_url=login_url(database_url, role),
            bootstrap_servers=kafka_bootstrap,
            subscribers=[sub("s", topic_prefix)],
            metrics_port=0,
            heartbeat_interval=0.3,
            session_timeout=3.0,
        ),
        registry=registry,
    )
    try:
        with relay:
            assert relay.http is not None
            url = f"http://127.0.0.1:{relay.http.port}/readyz"
            wait_until(lambda: http_get(url)[0] == 200, what="ready")
            db.execute(
                sql.SQL("REVOKE UPDATE ON outbox_relay_sessions FROM {}").format(
                    sql.Identifier(role)
                )
            )
            wait_until(lambda: http_get(url)[0] == 503, timeout=30, what="not ready")
            status, body = http_get(url)
            assert status == 503 and "permanent" in body, body
            assert "outbox-relay grant --relay-role" in body
        heartbeats = [
            r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()
        ]
        assert heartbeats and "permanent" in heartbeats[0]
    finally:
        name = sql.Identifier(role)
        db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))
