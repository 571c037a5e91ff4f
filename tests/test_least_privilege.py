"""The relay runs without superuser rights, on the grants `outbox-relay grant` gives."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from relay import Outbox
from relay.daemon import Relay
from relay.settings import load_settings
from tests.support import consume, run_cli, sub, write_orders

REPO = Path(__file__).resolve().parent.parent


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))


def test_relay_publishes_as_a_least_privilege_role(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: Any,
) -> None:
    relay_role, writer_role = f"relay_{uuid.uuid4().hex[:6]}", f"writer_{uuid.uuid4().hex[:6]}"
    granted = run_cli(
        "grant", "--relay-role", relay_role, "--writer-role", writer_role, "--create",
        env={"RELAY_DATABASE_URL": database_url},
    )  # fmt: skip
    assert granted.returncode == 0, granted.stderr
    try:
        with psycopg.connect(as_user(database_url, writer_role), autocommit=True) as app:
            write_orders(app, outbox, ["o-1", "o-2"])  # the app's role can write events
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute("DELETE FROM outbox")
        relay_url = as_user(database_url, relay_role)
        with psycopg.connect(relay_url) as conn:
            assert conn.execute(
                "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
            ).fetchone() == (False,)
        relay = Relay(
            load_settings(
                database_url=relay_url,
                bootstrap_servers=kafka_bootstrap,
                subscribers=[sub("s", topic_prefix)],
                metrics_port=0,
                heartbeat_interval=0.3,
                session_timeout=3.0,
            ),
            registry=registry,
        )
        with relay:
            seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 2)
        assert sorted(r.key for r in seen) == ["o-1", "o-2"]
    finally:
        for role in (relay_role, writer_role):
            name = sql.Identifier(role)
            db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))
