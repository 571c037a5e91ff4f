"""The relay's code never resolves to a function outside pg_catalog and its own schema
(issue #47, the CVE-2018-1058 pattern; docs/design.md §2, "Names").

On Postgres before 15 (and every cluster pg_upgraded from one) every role may CREATE in
`public`. There a role with no grant puts overloads of built-ins that match the relay's
calls better than pg_catalog's (an untyped literal, an integer where pg_catalog takes a
bigint, jsonb where it takes "any") and that record every call. Then the owner migrates
and grants, writers write as the writer role (through the write API and plain INSERTs,
with `public` on their path, before pg_catalog even), a relay publishes as the relay
role: none of them is ever called, and every event arrives once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from relay import Event, Outbox
from relay.adapters.postgres import migrations
from relay.adapters.postgres.queries import with_schema
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.ops.roles import grant_roles
from tests.support import (
    RELAY_ROLE,
    REPO,
    STRANGER_ROLE,
    WRITER_ROLE,
    as_role,
    consume,
    create_test_roles,
    order,
    run_cli,
    sub,
)

# What the role with no grant creates in `public`: a counter every role may bump (a
# sequence: its increments survive a rollback), a log every role may write, and the
# overloads. Each records its call, then does what the built-in does, so that nothing
# fails and only the records tell.
HOSTILE = """
CREATE SEQUENCE public.hijack_calls;
GRANT USAGE ON SEQUENCE public.hijack_calls TO PUBLIC;
CREATE TABLE public.hijack_log (fn text, by_role text);
GRANT INSERT ON public.hijack_log TO PUBLIC;
CREATE FUNCTION public.hijacked(fn text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.nextval('public.hijack_calls');
    INSERT INTO public.hijack_log VALUES (fn, current_user);
END $$;
CREATE FUNCTION public.convert_to(t text, enc text) RETURNS bytea LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('convert_to'); RETURN pg_catalog.convert_to(t, enc::name); END $$;
CREATE FUNCTION public.convert_from(b bytea, enc text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('convert_from'); RETURN pg_catalog.convert_from(b, enc::name); END $$;
CREATE FUNCTION public.currval(seq text) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('currval'); RETURN pg_catalog.currval(seq::regclass); END $$;
CREATE FUNCTION public.format(f text, a text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('format'); RETURN pg_catalog.format(f, a); END $$;
CREATE FUNCTION public.set_config(n text, v text, l boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('set_config'); RETURN pg_catalog.set_config(n, v, l); END $$;
CREATE FUNCTION public.hashtextextended(t text, seed integer) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM public.hijacked('hashtextextended');
    RETURN pg_catalog.hashtextextended(t, seed);
END $$;
CREATE FUNCTION public.pg_column_size(v jsonb) RETURNS integer LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('pg_column_size'); RETURN pg_catalog.pg_column_size(v); END $$;
CREATE FUNCTION public.pg_has_role(r name, g text, p text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('pg_has_role'); RETURN pg_catalog.pg_has_role(r, g, p); END $$;
CREATE FUNCTION public.unnest(a bigint[]) RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('unnest'); RETURN QUERY SELECT pg_catalog.unnest(a); END $$;
CREATE FUNCTION public.hostile_minus(a bigint, b integer) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM public.hijacked('-'); RETURN a OPERATOR(pg_catalog.-) b; END $$;
CREATE OPERATOR public.- (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = public.hostile_minus);
"""

# What in the database depends on the stranger's functions and operators (a stored
# definition bound to one): nothing may.
BOUND_TO_HOSTILE = """
SELECT pg_describe_object(d.classid, d.objid, d.objsubid)
  FROM pg_depend d
 WHERE d.refclassid IN ('pg_proc'::regclass, 'pg_operator'::regclass)
   AND d.classid <> 'pg_operator'::regclass
   AND d.refobjid IN (SELECT p.oid FROM pg_proc p WHERE p.proowner = %(stranger)s::regrole
                      UNION ALL
                      SELECT o.oid FROM pg_operator o WHERE o.oprowner = %(stranger)s::regrole)
 ORDER BY 1
"""


@pytest.fixture
def open_public(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """The test database with the `public` ACL of Postgres before 15, and the stranger's
    overloads in it; yields the owner's (a superuser's) connection. The database is
    dropped after the test, its ACL with it."""
    create_test_roles(database_url)
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        with psycopg.connect(as_role(database_url, STRANGER_ROLE), autocommit=True) as stranger:
            stranger.execute(HOSTILE)
            # The overloads do win where nothing guards against them: the test can fail.
            stranger.execute("SELECT convert_to('probe', 'UTF8')")
        assert calls(owner) == (1, [("convert_to", STRANGER_ROLE)])
        try:
            yield owner
        finally:
            owner.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")


def calls(conn: psycopg.Connection[Any]) -> tuple[int, list[tuple[str, str]]]:
    """How many times the overloads ran (rolled back or not), and the committed log."""
    row = conn.execute("SELECT last_value, is_called FROM public.hijack_calls").fetchone()
    assert row is not None
    log = conn.execute("SELECT fn, by_role FROM public.hijack_log").fetchall()
    return (row[0] if row[1] else 0), log


def bound_to_hostile(conn: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in conn.execute(BOUND_TO_HOSTILE, {"stranger": STRANGER_ROLE})]


PLAIN_INSERT = (
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
    "VALUES ('order', %s, 'OrderPlaced', %s::jsonb)"
)


def writer(database_url: str) -> psycopg.Connection[Any]:
    """The writer role, `public` first on its path: the app's session, not the relay's."""
    conn = psycopg.connect(as_role(database_url, WRITER_ROLE), autocommit=True)
    conn.execute("SET search_path = public, pg_catalog")
    return conn


def write_events(conn: psycopg.Connection[Any], outbox: Outbox, tag: str) -> None:
    """Events of every kind a writer writes: appends, an idempotent one, a stream of
    two versions (its order trigger compares versions), and plain INSERTs."""
    outbox.append(conn, aggregate_type="order", aggregate_id=f"{tag}-a",
                  event_type="OrderPlaced", payload=order(f"{tag}-a"))  # fmt: skip
    outbox.append(conn, aggregate_type="order", aggregate_id=f"{tag}-k",
                  event_type="OrderPlaced", payload=order(f"{tag}-k"),
                  idempotency_key=f"{tag}-key")  # fmt: skip
    outbox.append_to_stream(
        conn, aggregate_type="order", aggregate_id=f"{tag}-s", expected_version=0,
        events=[Event("OrderPlaced", order(f"{tag}-s1")), Event("OrderPlaced", order(f"{tag}-s2"))],
    )  # fmt: skip
    with conn.transaction():
        for i in (1, 2):
            conn.execute(PLAIN_INSERT, (f"{tag}-p{i}", json.dumps(order(f"{tag}-p{i}"))))


def test_hostile_overloads_in_public_are_never_called(
    open_public: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    owner = open_public
    # The owner's session is not pinned here (the migrations pin each of their own).
    migrations.migrate(owner, allow_public_create=True)
    grant_roles(owner, "public", relay_role=RELAY_ROLE, writer_role=WRITER_ROLE,
                create=True, allow_public_create=True)  # fmt: skip
    outbox = Outbox(registry)
    relay_url = as_role(database_url, RELAY_ROLE)
    topic = topic_prefix + "outbox.event.order"
    with writer(database_url) as app:
        write_events(app, outbox, "before")
        relay = Relay(
            load_settings(
                database_url=relay_url,
                bootstrap_servers=kafka_bootstrap,
                subscribers=[sub("hijack", topic_prefix, parts=2)],
                poll_interval=0.2,
                heartbeat_interval=0.3,
                session_timeout=3.0,
                metrics_port=0,
            ),
            registry=registry,
        )
        with relay:
            write_events(app, outbox, "after")
            seen = consume(kafka_bootstrap, [topic], 12)
            status = run_cli("status", "--json", env={"RELAY_DATABASE_URL": relay_url})
    assert status.returncode == 0, status.stderr
    written = owner.execute("SELECT message_id::text FROM outbox ORDER BY 1").fetchall()
    assert sorted(r.message_id or "" for r in seen) == [w[0] for w in written]
    assert len(written) == 12
    assert calls(owner) == (1, [("convert_to", STRANGER_ROLE)])  # the probe's, no other
    assert bound_to_hostile(owner) == []


def _migrate_as_before_0014(conn: psycopg.Connection[Any]) -> None:
    """Migrations 0001-0013 as releases before 0014 applied them: in the owner's session
    as it is, its search_path not pinned."""
    ledger = """CREATE TABLE IF NOT EXISTS {schema}.outbox_relay_migrations (
        version integer PRIMARY KEY, name text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now())"""
    for m in migrations.available():
        if m.version > 13:
            break
        with conn.transaction():
            conn.execute(with_schema(ledger, "public"))
            conn.execute(with_schema(m.sql, "public"))
            conn.execute(
                "INSERT INTO public.outbox_relay_migrations VALUES (%s, %s)", (m.version, m.name)
            )


def test_migration_14_unbinds_an_install_made_while_the_overloads_were_there(
    open_public: psycopg.Connection[Any], database_url: str, registry: SchemaFolder
) -> None:
    owner = open_public
    _migrate_as_before_0014(owner)
    # What the issue found: the order key's trigger took the stranger's currval, and the
    # part function its hashtextextended; every INSERT then runs the stranger's code.
    assert bound_to_hostile(owner) == [
        "function outbox_part(text,integer)",
        "trigger outbox_assign_order_key on table outbox",
    ]
    owner.execute(PLAIN_INSERT, ("old", '{"order_id": "old"}'))
    before = calls(owner)[0]
    assert before > 1
    applied = migrations.migrate(owner, allow_public_create=True)
    assert applied[0].version == 14
    assert bound_to_hostile(owner) == []
    grant_roles(owner, "public", relay_role=RELAY_ROLE, writer_role=WRITER_ROLE,
                create=True, allow_public_create=True)  # fmt: skip
    with writer(database_url) as app:
        write_events(app, Outbox(registry), "upgraded")
    with psycopg.connect(as_role(database_url, RELAY_ROLE)) as relay:
        relay.execute("SELECT public.outbox_part(aggregate_id, 4) FROM public.outbox")
    assert calls(owner)[0] == before


def readme_revoke() -> str:
    """The SQL block of deploy/README.md's "Security", "Names"."""
    text = (REPO / "deploy" / "README.md").read_text()
    section = text.split("**Names (`search_path`).**", 1)[1]
    return section.split("```sql\n", 1)[1].split("```", 1)[0]


def test_migrate_and_grant_refuse_a_schema_every_role_may_create_in(database_url: str) -> None:
    create_test_roles(database_url)
    env = {"RELAY_DATABASE_URL": database_url}
    grant = ("grant", "--relay-role", RELAY_ROLE)
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        refused = run_cli("migrate", env=env)
        assert refused.returncode == 1
        assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in refused.stderr
        assert "--allow-public-create" in refused.stderr
        assert owner.execute("SELECT to_regclass('public.outbox')").fetchone() == (None,)
        # In another schema, `public` on the owner's path is only a warning.
        elsewhere = run_cli("migrate", "--schema", "relay", env=env)
        assert elsewhere.returncode == 0, elsewhere.stderr
        assert "schema public, which is on this role's search_path" in elsewhere.stderr
        assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in elsewhere.stderr
        allowed = run_cli("migrate", "--allow-public-create", env=env)
        assert allowed.returncode == 0, allowed.stderr
        assert "allowed by --allow-public-create" in allowed.stderr
        refused = run_cli(*grant, env=env)
        assert refused.returncode == 1
        assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in refused.stderr
        assert run_cli(*grant, "--allow-public-create", env=env).returncode == 0
        owner.execute(readme_revoke())  # what deploy/README.md tells the operator to run
        assert run_cli(*grant, env=env).returncode == 0
        closed = run_cli("migrate", env=env)
        assert closed.returncode == 0, closed.stderr
        assert "CREATE" not in closed.stderr


def test_every_connection_of_the_relay_and_its_sinks_is_pinned(database_url: str) -> None:
    from relay.adapters.postgres import db
    from spark_jobs.postgres_sink import connect as sink_connect

    with db.connect(database_url) as conn:
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog, pg_temp",)
    with db.connect(database_url, autocommit=False) as conn:
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog, pg_temp",)
    # The sinks' tables live in the role's own schema: after pg_catalog, before pg_temp.
    with sink_connect(database_url) as conn:
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog, public, pg_temp",)
