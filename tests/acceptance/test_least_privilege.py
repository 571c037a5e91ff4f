"""The relay runs without superuser rights, on the grants `outbox-relay grant` gives."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Outbox
from relay.core.settings import load_settings
from relay.daemon import Relay
from tests.support import (
    ROLE_PASSWORD,
    STRANGER_ROLE,
    as_role,
    consume,
    keys,
    login_url,
    run_cli,
    sub,
    write_orders,
)

REPO = Path(__file__).resolve().parents[2]


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
        with psycopg.connect(login_url(database_url, writer_role), autocommit=True) as app:
            write_orders(app, outbox, ["o-1", "o-2"])  # the app's role can write events
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute("DELETE FROM outbox")
        relay_url = login_url(database_url, relay_role)
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
            assert relay.http is not None
            port = relay.http.port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = r.read().decode()
        assert keys(seen) == ["o-1", "o-2"]
        # Without pg_read_all_stats the horizon figure would be a false 0: it is left out.
        assert "\noutbox_relay_horizon_visible 0.0" in metrics
        assert "\noutbox_relay_horizon_held_seconds " not in metrics
    finally:
        for role in (relay_role, writer_role):
            name = sql.Identifier(role)
            db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))


def test_pg_read_all_stats_only_when_asked_and_status_says_what_is_hidden(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    role = f"relay_{uuid.uuid4().hex[:6]}"
    member = "SELECT pg_has_role(%s, 'pg_read_all_stats', 'MEMBER')"
    env = {"RELAY_DATABASE_URL": database_url}
    try:
        granted = run_cli("grant", "--relay-role", role, "--create", env=env)
        assert granted.returncode == 0, granted.stderr
        assert db.execute(member, (role,)).fetchone() == (False,)
        as_relay = {"RELAY_DATABASE_URL": login_url(database_url, role), "COLUMNS": "300"}
        with psycopg.connect(database_url, application_name="long-report") as holder:
            holder.execute("SELECT pg_current_xact_id()")  # the owner's open transaction
            blind = run_cli("status", env=as_relay)
            blind_json = json.loads(run_cli("status", "--json", env=as_relay).stdout)
            assert (
                run_cli("grant", "--relay-role", role, "--read-all-stats", env=env).returncode == 0
            )
            seeing = json.loads(run_cli("status", "--json", env=as_relay).stdout)
            holder.rollback()
        assert blind.returncode == 0, blind.stderr
        assert "hidden from this role" in blind.stderr and "--read-all-stats" in blind.stderr
        assert blind_json["horizon_holders_complete"] is False
        [hidden] = blind_json["horizon_holders"]  # there, but without its details
        assert (hidden["age_s"], hidden["state"]) == (None, None)
        assert hidden["application_name"] == "long-report"
        assert f"{hidden['pid']} " in blind.stdout and "hidden" in blind.stdout
        assert seeing["horizon_holders_complete"] is True
        assert [h["application_name"] for h in seeing["horizon_holders"]] == ["long-report"]
        assert db.execute(member, (role,)).fetchone() == (True,)
        # Granting again without the flag takes it back.
        assert run_cli("grant", "--relay-role", role, env=env).returncode == 0
        assert db.execute(member, (role,)).fetchone() == (False,)
    finally:
        name = sql.Identifier(role)
        db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))


def test_a_login_without_grants_can_neither_read_nor_write_nor_call_the_outbox(
    db: psycopg.Connection[Any], stranger_url: str
) -> None:
    """Any other role of the cluster (an injected query runs as one): nothing of the
    outbox is PUBLIC, least of all a SECURITY DEFINER function."""
    refused = [
        "SELECT count(*) FROM outbox",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " VALUES ('order', 'x', 'OrderPlaced', '{}')",
        "SELECT count(*) FROM outbox_checkpoints",
        "UPDATE outbox_subscribers SET paused = true",
        "SELECT count(*) FROM outbox_relay_sessions",
        "SELECT outbox_check_key_space()",
    ]
    with psycopg.connect(stranger_url, autocommit=True) as stranger:
        for statement in refused:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                stranger.execute(statement)
    callable_definers = db.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = 'public' AND p.prosecdef"
        " AND has_function_privilege(%s, p.oid, 'EXECUTE')",
        (STRANGER_ROLE,),
    ).fetchall()
    assert callable_definers == []


def _owner_of(database_url: str, role: str, attributes: str) -> str:
    """``database_url``'s database, handed to ``role`` (created, not a superuser, with
    ``attributes``): the owner deploy/README.md describes; its URL."""
    with psycopg.connect(database_url, autocommit=True) as admin:
        name = sql.Identifier(role)
        if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                name, sql.Literal(ROLE_PASSWORD)))  # fmt: skip
        admin.execute(sql.SQL("ALTER ROLE {} NOSUPERUSER " + attributes).format(name))
        dbname = admin.execute("SELECT current_database()").fetchone()
        assert dbname is not None
        admin.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
            sql.Identifier(dbname[0]), name))  # fmt: skip
    return as_role(database_url, role)


def _drop_roles(database_url: str, *roles: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as admin:
        for role in roles:
            name = sql.Identifier(role)
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                admin.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE {}").format(name, name))


def test_grant_create_works_for_an_owner_with_createrole_only(
    database_url: str, outbox: Outbox
) -> None:
    """The owner of deploy/README.md, "Roles": not a superuser, CREATEROLE to create the
    relay's and the writers' roles (issue #47)."""
    owner_url = _owner_of(database_url, "outbox_test_owner", "CREATEROLE")
    relay_role, writer_role = f"relay_{uuid.uuid4().hex[:6]}", f"writer_{uuid.uuid4().hex[:6]}"
    env = {"RELAY_DATABASE_URL": owner_url}
    try:
        assert run_cli("migrate", env=env).returncode == 0
        granted = run_cli(
            "grant", "--create", "--relay-role", relay_role, "--writer-role", writer_role,
            "--connection-limit", "8", env=env,
        )  # fmt: skip
        assert granted.returncode == 0, granted.stderr
        # Again: what it already is stays as it is.
        assert run_cli("grant", "--create", "--relay-role", relay_role, env=env).returncode == 0
        with psycopg.connect(login_url(database_url, writer_role), autocommit=True) as app:
            write_orders(app, outbox, ["o-1"])
        status = run_cli("status", env={"RELAY_DATABASE_URL": login_url(database_url, relay_role)})
        assert status.returncode == 0, status.stderr
    finally:
        _drop_roles(database_url, relay_role, writer_role)


def test_grant_works_for_an_owner_without_createrole_on_roles_made_beforehand(
    database_url: str,
) -> None:
    """Without CREATEROLE the operator creates the roles and drops --create
    (deploy/k8s/README.md): grant then asks for nothing that owner lacks; what it cannot
    do (pg_read_all_stats) it says who can."""
    owner_url = _owner_of(database_url, "outbox_test_plain_owner", "NOCREATEROLE")
    relay_role, writer_role = f"relay_{uuid.uuid4().hex[:6]}", f"writer_{uuid.uuid4().hex[:6]}"
    env = {"RELAY_DATABASE_URL": owner_url}
    try:
        with psycopg.connect(database_url, autocommit=True) as admin:
            for role in (relay_role, writer_role):
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            assert run_cli("migrate", env=env).returncode == 0
            granted = run_cli("grant", "--relay-role", relay_role, "--writer-role", writer_role,
                              env=env)  # fmt: skip
            assert granted.returncode == 0, granted.stderr
            stats = run_cli("grant", "--relay-role", relay_role, "--read-all-stats", env=env)
            assert stats.returncode == 1
            assert f"ask a superuser to run `GRANT pg_read_all_stats TO {relay_role}`" in (
                " ".join(stats.stderr.split())
            )
            admin.execute(
                sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(relay_role))
            )
            stats = run_cli("grant", "--relay-role", relay_role, "--read-all-stats", env=env)
            assert stats.returncode == 0, stats.stderr
    finally:
        _drop_roles(database_url, relay_role, writer_role)
