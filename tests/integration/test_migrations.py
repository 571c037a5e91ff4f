"""Migrations: idempotent, concurrent-safe, and they reproduce relay/adapters/postgres/sql/schema.sql."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import migrations
from relay.adapters.postgres.queries import read_sql, with_schema
from relay.errors import LockTimeout
from tests.support import STRANGER_ROLE

# Everything that defines the schema, in a form that does not depend on the schema name.
_CATALOG = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
          FROM information_schema.columns WHERE table_schema = %(s)s
         ORDER BY table_name, column_name""",
    "indexes": """
        SELECT tablename, indexname, replace(indexdef, %(s)s || '.', '')
          FROM pg_indexes WHERE schemaname = %(s)s ORDER BY indexname""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, replace(pg_get_constraintdef(oid), %(s)s || '.', '')
          FROM pg_constraint WHERE connamespace = %(s)s::regnamespace ORDER BY conname""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, replace(pg_get_triggerdef(oid), %(s)s || '.', '')
          FROM pg_trigger WHERE NOT tgisinternal
           AND tgrelid::regclass::text LIKE %(s)s || '.%%' ORDER BY tgname""",
    # The whole definition: its body (an SQL-standard body is not in prosrc), and its
    # SECURITY DEFINER and SET search_path (migration 0014).
    "functions": """
        SELECT proname, replace(pg_get_functiondef(oid), %(s)s || '.', '') FROM pg_proc
         WHERE pronamespace = %(s)s::regnamespace ORDER BY proname""",
}


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    found = {}
    for name, query in _CATALOG.items():
        rows = conn.execute(query, {"s": schema}).fetchall()
        found[name] = [tuple(_unqualify(str(v), schema) for v in row) for row in rows]
    return found


def _unqualify(text: str, schema: str) -> str:
    return text.replace(f'"{schema}".', "").replace(f"{schema}.", "")


def test_migrations_reproduce_the_schema_file(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, "migrated")
        conn.execute(with_schema(read_sql("schema.sql"), "declared"))
        migrated, declared = catalog(conn, "migrated"), catalog(conn, "declared")
    # The ledger exists only where migrations ran.
    migrated = {
        k: [r for r in v if "outbox_relay_migrations" not in r[0]] for k, v in migrated.items()
    }
    assert migrated["columns"], "migrations created no tables"
    assert migrated == declared


def test_migrate_is_idempotent(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        first = migrations.migrate(conn)
        second = migrations.migrate(conn)
        assert [m.version for m in first] == [m.version for m in migrations.available()]
        assert second == []
        assert migrations.pending(conn) == []


def test_concurrent_migrations_apply_each_version_once(database_url: str) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                migrations.migrate(conn, "shared")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with psycopg.connect(database_url) as conn:
        versions = conn.execute("SELECT version FROM shared.outbox_relay_migrations").fetchall()
    assert versions == [(m.version,) for m in migrations.available()]


def test_a_migration_lock_held_by_another_role_times_out_naming_it(
    db: psycopg.Connection[Any], stranger_url: str
) -> None:
    """Any role may take the migration lock's key (issue #47): migrate waits a bounded
    time for it, then fails naming the session that holds it."""
    with psycopg.connect(stranger_url, autocommit=True, application_name="squatter") as other:
        row = other.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        other.execute("SELECT pg_advisory_lock(%s)", (migrations.LOCK_KEY,))
        with pytest.raises(LockTimeout) as refused:
            migrations.migrate(db, lock_wait_s=0.2)
    message = str(refused.value)
    assert f"held by pid {row[0]} (role {STRANGER_ROLE}, application 'squatter')" in message
    assert f"pg_terminate_backend({row[0]})" in message
    assert migrations.migrate(db) == []  # the lock is free again: migrate goes on


def test_migrate_cli_creates_tables_in_a_custom_schema(database_url: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay.cli",
            "migrate",
            "--database-url",
            database_url,
            "--schema",
            "My Schema",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    with psycopg.connect(database_url) as conn:
        row = conn.execute("""SELECT count(*) FROM "My Schema".outbox""").fetchone()
    assert row == (0,)


def _relay_as_owner(database_url: str, kafka_bootstrap: str, topic_prefix: str) -> Any:
    """A started relay, as the owner: on a schema with migrations pending, `grant` (which
    makes the relay role) refuses to run (tests/README.md, "Roles")."""
    from relay.core.settings import load_settings
    from relay.daemon import Relay

    relay = Relay(
        load_settings(
            database_url=database_url,
            bootstrap_servers=kafka_bootstrap,
            subscribers=[{"name": "s", "topic": topic_prefix + "{aggregate_type}"}],
            poll_interval=0.2,
            metrics_port=0,
        )
    )
    relay.start()
    return relay


def test_a_rolling_deploy_publishes_everything_across_migration_3(
    database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    """The relay runs on the schema before 0003 (NOTIFY trigger, raw xids); 0003 is then
    applied under it while writers go on: every row is published once, in order."""
    from relay import Outbox
    from tests.support import consume, ids_of, write_orders

    outbox = Outbox(None)
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=2)
        write_orders(conn, outbox, ["before-1", "before-2"], key="k")
        relay = _relay_as_owner(database_url, kafka_bootstrap, topic_prefix)
        try:
            write_orders(conn, outbox, ["old-schema"], key="k")
            assert migrations.migrate(conn)  # 0003, under the running relay
            write_orders(conn, outbox, ["new-schema-1", "new-schema-2"], key="k")
            seen = consume(kafka_bootstrap, [topic_prefix + "order"], 5)
        finally:
            relay.stop()
        written = conn.execute("SELECT message_id::text FROM outbox ORDER BY position").fetchall()
    assert ids_of(seen) == [w[0] for w in written]


def test_the_lag_is_read_on_a_schema_before_migration_18(database_url: str) -> None:
    """Relays that roll before `migrate` (a rolling deploy) read the lag without
    recorded_at: from occurred_at, as before 0018; after it, from recorded_at."""
    from relay.adapters.postgres.store import OutboxStore
    from relay.core.subscribers import Subscriber
    from relay.ops.lag import subscriber_lag

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=13)
        store = OutboxStore(conn)
        store.add(Subscriber("s", topic="t"))
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)"
            " VALUES ('order', 'o-1', 'OrderPlaced', '{}', now() - interval '1 hour')"
        )
        before = subscriber_lag(store, store.get("s"))
        migrations.migrate(conn)
        after = subscriber_lag(store, store.get("s"))
    assert before.events == after.events == 1
    assert before.seconds >= 3600 > after.seconds


def test_a_rolling_deploy_publishes_everything_across_migration_15(
    database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Writers of this version append with idempotency keys on the schema before 0015,
    under a running relay; 0015 is then applied under both: every event is published
    once, in order, and a retry after the migration still finds its key."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    from relay import Outbox
    from tests.support import consume, ids_of, order

    outbox = Outbox(None)

    def append(conn: psycopg.Connection[Any], i: str) -> Any:
        return outbox.append(conn, aggregate_type="order", aggregate_id="k",
                             event_type="OrderPlaced", payload=order(i), idempotency_key=i)  # fmt: skip

    # Before 0017 a row's new topic waits for the outbox's record of the topics it
    # created; an existing one is published to as before.
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_prefix + "order", 1)])[topic_prefix + "order"].result()
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=14)
        append(conn, "before")
        relay = _relay_as_owner(database_url, kafka_bootstrap, topic_prefix)
        try:
            append(conn, "old-schema")
            assert [m.version for m in migrations.migrate(conn, up_to=15)] == [
                15
            ]  # under the relay
            first = append(conn, "new-schema-1")
            assert append(conn, "new-schema-1") == first
            append(conn, "new-schema-2")
            seen = consume(kafka_bootstrap, [topic_prefix + "order"], 4)
        finally:
            relay.stop()
        written = conn.execute("SELECT message_id::text FROM outbox ORDER BY position").fetchall()
    assert ids_of(seen) == [w[0] for w in written] and len(written) == 4


def test_a_relay_runs_on_a_schema_before_migration_19(database_url: str) -> None:
    """Relays that roll before `migrate` read a part without a skip list and halt
    without recording the event; status reads the last reset as before the ledger.
    After it, the reset 0009 recorded is on the ledger, counted as status counted it."""
    from relay.adapters.postgres.queries import queries_for
    from relay.adapters.postgres.store import OutboxStore
    from relay.core.subscribers import Subscriber

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=18)
        store = OutboxStore(conn)
        store.add(Subscriber("s", topic="t"))
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', n::text, 'OrderPlaced', '{}' FROM generate_series(1, 3) AS n"
        )
        # A reset forward, as the previous version made it: no ledger to write.
        reset = queries_for("public")["reset_checkpoint"]
        conn.execute(reset, {"name": "s", "to": "now", "transaction_id": 0, "position": 0})
        session = store.open_session("host", 1, 60)
        assert store.claim("s", 0, session)
        part = store.get_part("s", 0)
        assert part.skips == frozenset()
        store.halt(part, session, "poison event", uuid.uuid4())
        assert store.get_part("s", 0).halted_error == "poison event"
        [before] = store.part_skips("s", None)
        assert (before.counted, before.by_reset) == (3, 0)
        assert store.operator_skips(part.subscriber_id) == []

        migrations.migrate(conn)
        [after] = store.part_skips("s", None)
        assert (after.counted, after.by_reset, after.by_skip) == (None, 3, 0)
        [entry] = store.ledger("s")
        assert (entry.action, entry.events) == ("reset", 3)
        assert "migration 0019" in entry.params["recorded_by"]
