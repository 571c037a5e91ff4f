"""Untrusted writers (deploy/README.md, "Threat model: what a writer role can and cannot
do"): a hostile writer role, and a role with no grant at all, against the outbox's
defences. Roles as `outbox-relay grant` makes them."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Event, Outbox
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import Subscriber
from relay.errors import ConcurrencyError, RelayError
from relay.ops.roles import grant_roles
from tests.support import login_url, run_cli, write_orders

DEBEZIUM_TABLE = (
    "CREATE TABLE outbox_events (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,"
    " aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)"
)
# What a hostile role would have the copy function do: its own topic, forged headers.
FORGED_OPTIONS = json.dumps(
    {
        "id": "id", "key": "aggregateid", "type": "type", "payload": "payload",
        "payload_kind": "jsonb", "timestamp": None, "route": "aggregatetype",
        "replacement": "stolen.${routedByValue}", "tracing": None,
        "headers": [["payload", "outbox.error"], ["payload", "id"]], "envelope": [],
        "required": ["id", "aggregatetype", "payload"],
        "converters": {"key": "string", "value": "string", "header": "simple",
                       "header_schemas": None, "expand": False, "tombstone": False},
    }
)  # fmt: skip


@dataclass(frozen=True)
class Roles:
    writer: str  # `grant --writer-role`
    nobody: str  # LOGIN, and no grant at all
    url: str

    def connect(self, role: str) -> psycopg.Connection[Any]:
        return psycopg.connect(login_url(self.url, role), autocommit=True)


@pytest.fixture
def roles(db: psycopg.Connection[Any], database_url: str) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:6]
    found = Roles(f"writer_{suffix}", f"nobody_{suffix}", database_url)
    grant_roles(db, "public", writer_role=found.writer, create=True)
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(found.nobody)))
    try:
        yield found
    finally:
        for role in (found.writer, found.nobody):
            name = sql.Identifier(role)
            db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))


def count(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


# -- the Debezium copy function ------------------------------------------------------------


def test_no_role_but_the_owner_can_put_the_copy_function_on_a_table(
    db: psycopg.Connection[Any], database_url: str, roles: Roles
) -> None:
    db.execute(DEBEZIUM_TABLE)
    attached = run_cli("debezium", "attach", "public.outbox_events",
                       env={"RELAY_DATABASE_URL": database_url})  # fmt: skip
    assert attached.returncode == 0, attached.stderr
    for role in (roles.nobody, roles.writer):
        with roles.connect(role) as hostile:
            hostile.execute(
                "CREATE TEMP TABLE forged (id uuid, aggregatetype text, aggregateid text,"
                " type text, payload jsonb)"
            )
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                hostile.execute(
                    sql.SQL(
                        "CREATE TRIGGER t AFTER INSERT ON forged FOR EACH ROW "
                        "EXECUTE FUNCTION public.outbox_from_debezium({})"
                    ).format(sql.Literal(FORGED_OPTIONS))
                )
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                hostile.execute("SELECT * FROM outbox_debezium_tables")
    assert count(db) == 0


def test_the_copy_function_refuses_a_table_attach_did_not_register(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    db.execute(DEBEZIUM_TABLE)
    db.execute("CREATE TABLE other_events (LIKE outbox_events)")
    assert run_cli("debezium", "attach", "other_events",
                   env={"RELAY_DATABASE_URL": database_url}).returncode == 0  # fmt: skip
    db.execute(
        sql.SQL(
            "CREATE TRIGGER by_hand AFTER INSERT ON outbox_events FOR EACH ROW "
            "EXECUTE FUNCTION outbox_from_debezium({})"
        ).format(sql.Literal(FORGED_OPTIONS))
    )
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not attached"):
        db.execute("INSERT INTO outbox_events VALUES (gen_random_uuid(), 'order', 'k', 't', '{}')")
    # Once attached, the registry's options count: the trigger's own argument does not.
    db.execute("DROP TRIGGER by_hand ON outbox_events")
    assert run_cli("debezium", "attach", "outbox_events",
                   env={"RELAY_DATABASE_URL": database_url}).returncode == 0  # fmt: skip
    db.execute("INSERT INTO outbox_events VALUES (gen_random_uuid(), 'order', 'k', 't', '{}')")
    row = db.execute("SELECT debezium ->> 'topic' FROM outbox").fetchone()
    assert row == ("outbox.event.order",)
    # detach: inserts are no longer copied, and the options are gone.
    detached = run_cli("debezium", "detach", "outbox_events",
                       env={"RELAY_DATABASE_URL": database_url})  # fmt: skip
    assert detached.returncode == 0, detached.stderr
    db.execute("INSERT INTO outbox_events VALUES (gen_random_uuid(), 'order', 'k', 't', '{}')")
    assert count(db) == 1
    registered = db.execute("SELECT array_agg(source::text) FROM outbox_debezium_tables")
    assert registered.fetchone() == (["other_events"],)


def test_an_upgrade_keeps_attached_tables_options_and_rows_beyond_the_new_limits(
    database_url: str,
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=7)
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('order', repeat('k', 2000), 'Created', '{}')"
        )  # legal before 0008
        conn.execute(DEBEZIUM_TABLE)
        # As attach left a table before 0008: the options in the trigger's argument (the
        # function's old body does not matter: 0008 replaces it).
        conn.execute(
            "CREATE FUNCTION outbox_from_debezium() RETURNS trigger LANGUAGE plpgsql "
            "SECURITY DEFINER AS $$ BEGIN RETURN NULL; END $$"
        )
        options = json.loads(FORGED_OPTIONS) | {"replacement": "kept.${routedByValue}"}
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER outbox_relay_copy_outbox_events AFTER INSERT ON outbox_events "
                "FOR EACH ROW EXECUTE FUNCTION outbox_from_debezium({})"
            ).format(sql.Literal(json.dumps(options)))
        )
        migrations.migrate(conn)
        conn.execute(
            "INSERT INTO outbox_events VALUES (gen_random_uuid(), 'order', 'k', 't', '{}')"
        )
        row = conn.execute("SELECT debezium ->> 'topic' FROM outbox WHERE debezium IS NOT NULL")
        assert row.fetchone() == ("kept.order",)
        public = conn.execute(
            "SELECT has_function_privilege('public', 'outbox_from_debezium()', 'EXECUTE')"
        ).fetchone()
        assert public == (False,)


# -- the ordering key ----------------------------------------------------------------------


def forge_key(db: psycopg.Connection[Any], where: str) -> None:
    """A superuser's UPDATE with triggers off: a key the outbox did not assign."""
    with db.transaction():
        db.execute("SET LOCAL session_replication_role = replica")
        db.execute("UPDATE outbox SET transaction_id = '9000000000000000000' " + where)


def test_a_writer_cannot_move_a_rows_key_and_a_forged_key_triggers_no_rebase(
    db: psycopg.Connection[Any], outbox: Outbox, roles: Roles
) -> None:
    write_orders(db, outbox, [f"o-{i}" for i in range(5)])
    db.execute(sql.SQL("GRANT UPDATE ON outbox TO {}").format(sql.Identifier(roles.writer)))
    with roles.connect(roles.writer) as hostile:
        for column, value in (("transaction_id", "'9000000000000000000'"), ("position", "DEFAULT")):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="cannot be changed"):
                hostile.execute(f"UPDATE outbox SET {column} = {value} WHERE aggregate_id = 'o-0'")
        hostile.execute("UPDATE outbox SET occurred_at = now()")  # other columns: as granted
    # A key that got in anyway (the owner, triggers off): evidence of a move is missing.
    forge_key(db, "WHERE position = (SELECT min(position) FROM outbox)")
    check = OutboxStore(db).check_key_space()
    assert check is not None
    assert (check.action, check.rebased_rows) == ("unchanged", 0)
    assert check.detail is not None and "not rebased" in check.detail
    assert db.execute("SELECT rebased_rows FROM outbox_key_space").fetchone() == (0,)


def test_a_checkpoint_above_the_clusters_ids_is_evidence_of_a_move(
    db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    """A dump restored into a clone of its cluster: same system identifier, a last check
    long ago, but the relays' checkpoints (from published rows) are above the ids."""
    store = OutboxStore(db)
    store.add(Subscriber("s"))
    write_orders(db, outbox, ["o-1", "o-2"])
    forge_key(db, "")
    db.execute("UPDATE outbox_checkpoints SET transaction_id = '9000000000000000000'")
    check = store.check_key_space()
    assert check is not None and (check.action, check.rebased_rows) == ("rebased", 2)


def test_a_rebase_gives_up_instead_of_stalling_writers(
    db: psycopg.Connection[Any], database_url: str, outbox: Outbox
) -> None:
    write_orders(db, outbox, ["o-1"])
    # A real move (another cluster's system identifier, keys above this one's ids)...
    db.execute("UPDATE outbox_key_space SET system_identifier = system_identifier + 1")
    forge_key(db, "")
    # ... while a writer's transaction stays open on the outbox.
    with psycopg.connect(database_url) as writer:
        write_orders(writer, outbox, ["in-flight"])
        with psycopg.connect(database_url, autocommit=True) as relay:
            relay.execute("SET statement_timeout = '20s'")  # the old code waits forever
            with pytest.raises(RelayError, match="lock timeout"):
                OutboxStore(relay).check_key_space()
        writer.rollback()
    check = OutboxStore(db).check_key_space()  # writers gone: the rebase goes through
    assert check is not None and (check.action, check.rebased_rows) == ("rebased", 1)


# -- what a writer may read ----------------------------------------------------------------


def test_a_writer_reads_no_payloads_and_the_write_api_works_without(
    db: psycopg.Connection[Any], outbox: Outbox, roles: Roles
) -> None:
    write_orders(db, outbox, ["other-tenant"])
    # What earlier versions granted, then `grant` again (twice: it is idempotent).
    db.execute(sql.SQL("GRANT SELECT ON outbox TO {}").format(sql.Identifier(roles.writer)))
    for _ in range(2):
        granted = run_cli("grant", "--writer-role", roles.writer,
                          env={"RELAY_DATABASE_URL": roles.url})  # fmt: skip
        assert granted.returncode == 0, granted.stderr
    with roles.connect(roles.writer) as app:
        for column in ("payload", "headers", "*"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(f"SELECT {column} FROM outbox")
        first = outbox.append(
            app, aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced",
            payload={"order_id": "o-1", "customer_id": "c", "amount_cents": 1},
            idempotency_key="req-1",
        )  # fmt: skip
        again = outbox.append(
            app, aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced",
            payload={"order_id": "o-1", "customer_id": "c", "amount_cents": 1},
            idempotency_key="req-1",
        )  # fmt: skip
        assert again == first
        shipped = [Event("OrderShipped", {"order_id": "s", "carrier": "c"})]
        with app.transaction():
            outbox.append_to_stream(
                app, aggregate_type="order", aggregate_id="s", expected_version=0, events=shipped
            )
            outbox.append_to_stream(
                app, aggregate_type="order", aggregate_id="s", expected_version=1, events=shipped
            )
        with pytest.raises(ConcurrencyError):
            outbox.append_to_stream(
                app, aggregate_type="order", aggregate_id="s", expected_version=1, events=shipped
            )
    assert count(db) == 4


# -- key-like column limits ----------------------------------------------------------------


def wide(byte_count: int) -> str:
    """Random 4-byte characters (nothing to compress), ``byte_count`` bytes in UTF-8."""
    assert byte_count % 4 == 0
    return "".join(chr(random.randrange(0x20000, 0x2A6DF)) for _ in range(byte_count // 4))


def test_key_like_columns_have_limits_and_a_row_within_them_never_fails(
    db: psycopg.Connection[Any], roles: Roles
) -> None:
    insert = (
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers,"
        " idempotency_key) VALUES (%s, %s, %s, '{}', %s, %s)"
    )
    headers = json.dumps({"h": "x" * 65_000})
    with roles.connect(roles.writer) as app:
        # Every limit reached at once, in characters of 4 bytes that do not compress.
        app.execute(insert, ("t" * 255, wide(1024), "e" * 255, headers, wide(1024)))
        for too_long, constraint in (
            (("t" * 256, "k", "e", "{}", None), "outbox_aggregate_type_length"),
            (("t", wide(1024) + "k", "e", "{}", None), "outbox_aggregate_id_length"),
            (("t", "k", "e" * 256, "{}", None), "outbox_event_type_length"),
            (("t", "k", "e", "{}", "k" * 1025), "outbox_idempotency_key_length"),
            (("t", "k", "e", json.dumps({"h": "x" * 65_536}), None), "outbox_headers_size"),
        ):
            with pytest.raises(psycopg.errors.CheckViolation, match=constraint):
                app.execute(insert, too_long)
    assert count(db) == 1


def test_grant_on_a_schema_that_lacks_migrations_says_to_migrate(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=7)
    granted = run_cli("grant", "--relay-role", "nobody_here", "--create",
                      env={"RELAY_DATABASE_URL": database_url})  # fmt: skip
    assert granted.returncode != 0
    assert "0008_untrusted_writers" in granted.stderr and "outbox-relay migrate" in granted.stderr


def test_a_debezium_row_beyond_the_limits_is_copied_not_refused(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    db.execute(
        "CREATE TABLE long_events (id text, aggregatetype text, aggregateid text, type text,"
        " payload text)"
    )
    assert run_cli("debezium", "attach", "long_events",
                   env={"RELAY_DATABASE_URL": database_url}).returncode == 0  # fmt: skip
    key, route, kind = wide(4096), "r" * 300, "t" * 300
    db.execute("INSERT INTO long_events VALUES ('e-1', %s, %s, %s, '{}')", (route, key, kind))
    row = db.execute(
        "SELECT octet_length(aggregate_id), octet_length(aggregate_type),"
        " octet_length(event_type), debezium ->> 'key', debezium ->> 'route' FROM outbox"
    ).fetchone()
    assert row == (1024, 63, 63, key, route)  # cut in the relay's columns, whole for Debezium
