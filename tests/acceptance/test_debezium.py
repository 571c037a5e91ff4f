"""Debezium Outbox Event Router users switch without changing their apps."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.adapters.postgres.store import OutboxStore
from relay.daemon import Relay
from tests.support import WRITER_ROLE, consume, run_cli, sub

DEBEZIUM_TABLE = (
    "CREATE TABLE outbox_events (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,"
    " aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)"
)


def test_rows_written_for_debezium_are_published_like_the_event_router_would(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    db.execute(DEBEZIUM_TABLE)
    attached = run_cli(
        "debezium", "attach", "public.outbox_events", env={"RELAY_DATABASE_URL": database_url}
    )
    assert attached.returncode == 0, attached.stderr
    grant_app(db, "outbox_events")
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])

    ids = [uuid.uuid4() for _ in range(3)]
    with writer_db.transaction():  # what an app written for Debezium does, unchanged
        for i, event_id in enumerate(ids):
            writer_db.execute(
                "INSERT INTO outbox_events VALUES (%s, 'Order', %s, 'OrderCreated', %s)",
                (event_id, f"42{i}", json.dumps({"n": i})),
            )
        writer_db.execute("DELETE FROM outbox_events")  # many apps delete at once
    with writer_db.transaction(force_rollback=True):  # a rolled-back event is never published
        writer_db.execute(
            "INSERT INTO outbox_events VALUES (%s, 'Order', 'x', 'OrderCreated', '{}')",
            (uuid.uuid4(),),
        )
    db.execute("CREATE TABLE text_events (id text, aggregatetype text, aggregateid text,"
               " type text, payload text)")  # fmt: skip
    attach(database_url, "text_events")
    grant_app(db, "text_events")
    writer_db.execute("INSERT INTO text_events VALUES ('t-1', 'Note', 'n', 'Noted', '{\"n\": 9}')")
    writer_db.execute("INSERT INTO text_events VALUES ('t-2', 'Note', 'n', 'Noted', 'plain')")
    notes = consume(kafka_bootstrap, [topic_prefix + "outbox.event.Note"], 2)
    # The json format: text holding JSON is JSON, other text a JSON string.
    assert [json.loads(r.value or b"") for r in notes] == [{"n": 9}, "plain"]
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.Order"], 3)
    assert sorted(r.key for r in seen) == [b"420", b"421", b"422"]
    by_id = {r.message_id: r for r in seen}
    assert set(by_id) == {str(i) for i in ids}
    assert json.loads(by_id[str(ids[1])].value or b"") == {"n": 1}
    assert by_id[str(ids[0])].header_text("event_type") == "OrderCreated"


def grant_app(db: psycopg.Connection[Any], *tables: str) -> None:
    """The app's own tables are the app's: the writer role may write them (the attach
    trigger then writes the outbox on its behalf)."""
    for table in tables:
        db.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                sql.Identifier(table), sql.Identifier(WRITER_ROLE)
            )
        )


# -- the debezium format -------------------------------------------------------------


@pytest.fixture
def debezium_relay(start_relay: Callable[..., Relay], topic_prefix: str) -> Callable[[], Relay]:
    """Starts a relay whose one subscriber publishes in the debezium format."""
    return lambda: start_relay(subscribers=[sub("s", topic_prefix, value_format="debezium")])


def attach(database_url: str, table: str, *options: str) -> None:
    args = [a for o in options for a in ("-o", o)]
    done = run_cli("debezium", "attach", table, *args, env={"RELAY_DATABASE_URL": database_url})
    assert done.returncode == 0, done.stderr


def route(prefix: str) -> str:
    return f"route.topic.replacement={prefix}outbox.event.${{routedByValue}}"


def test_attach_never_fails_an_insert_debezium_accepts(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    debezium_relay: Callable[[], Relay],
) -> None:
    # Everything nullable and of other types than the relay's own outbox: ids that are
    # not uuids, a text payload, and a second table with bytes.
    db.execute(
        "CREATE TABLE events (id varchar(64) PRIMARY KEY, aggregatetype text,"
        " aggregateid text, type text, payload text)"
    )
    db.execute(
        "CREATE TABLE blobs (id bigint PRIMARY KEY, aggregatetype text,"
        " aggregateid bigint, type text, payload bytea)"
    )
    attach(database_url, "events", route(topic_prefix))
    attach(database_url, "blobs", route(topic_prefix), "value.converter=JsonConverter",
           "value.converter.schemas.enable=false")  # fmt: skip
    grant_app(db, "events", "blobs")
    debezium_relay()

    with writer_db.transaction():
        writer_db.execute(
            "INSERT INTO events VALUES ('evt-42', 'Order', 'o-1', 'Created', 'not json')"
        )
        writer_db.execute(
            "INSERT INTO events VALUES ('evt-43', 'Order', NULL, 'Created', '{\"a\":1}')"
        )
        writer_db.execute("INSERT INTO events VALUES ('evt-44', 'Order', 'o-1', NULL, NULL)")
        writer_db.execute("INSERT INTO events VALUES ('evt-45', '', 'o-2', '', '[]')")
        writer_db.execute("INSERT INTO blobs VALUES (7, 'Blob', 99, 'Stored', '\\x00ff10'::bytea)")
        writer_db.execute("DELETE FROM events WHERE id = 'evt-44'")  # inserted and deleted: kept

    seen = consume(
        kafka_bootstrap,
        [f"{topic_prefix}outbox.event.Order", f"{topic_prefix}outbox.event.Blob",
         f"{topic_prefix}outbox.event."],
        5,
        timeout=60,
    )  # fmt: skip
    by_id = {r.header("id"): r for r in seen}
    assert set(by_id) == {b"evt-42", b"evt-43", b"evt-44", b"evt-45", b"7"}
    assert (by_id[b"evt-42"].key, by_id[b"evt-42"].value) == (b"o-1", b"not json")
    assert by_id[b"evt-43"].key is None  # no aggregateid: no key, as Debezium
    assert by_id[b"evt-44"].value is None  # NULL payload
    assert by_id[b"evt-45"].topic == f"{topic_prefix}outbox.event."
    blob = by_id[b"7"]
    assert (blob.key, blob.topic) == (b"99", f"{topic_prefix}outbox.event.Blob")
    assert json.loads(blob.value or b"") == base64.b64encode(b"\x00\xff\x10").decode()
    # Each key's events keep their order within its partition.
    o1 = [r.header("id") for r in seen if r.key == b"o-1"]
    assert o1 == [b"evt-42", b"evt-44"]


def test_router_options_renamed_columns_headers_envelope_tracing_and_timestamp(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    debezium_relay: Callable[[], Relay],
) -> None:
    db.execute(
        "CREATE TABLE shop_outbox (uid uuid PRIMARY KEY, kind text, entity text, stream text,"
        " body jsonb, created timestamp, tenant text, tracingspancontext text)"
    )
    attach(
        database_url,
        "public.shop_outbox",
        "transforms.outbox.table.field.event.id=uid",
        "transforms.outbox.table.field.event.key=entity",
        "transforms.outbox.table.field.event.type=kind",
        "transforms.outbox.table.field.event.payload=body",
        "transforms.outbox.table.field.event.timestamp=created",
        "transforms.outbox.route.by.field=stream",
        f"transforms.outbox.route.topic.replacement={topic_prefix}shop.${{routedByValue}}.events",
        "transforms.outbox.table.fields.additional.placement=kind:header:eventType,"
        "tenant:envelope:tenant,kind:envelope",
        "transforms.outbox.table.expand.json.payload=true",
        "transforms.outbox.route.tombstone.on.empty.payload=true",
        "key.converter=org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable=false",
        "value.converter=org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable=false",
    )
    grant_app(db, "shop_outbox")
    debezium_relay()
    first, gone = uuid.uuid4(), uuid.uuid4()
    trace = "traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n"
    writer_db.execute(
        "INSERT INTO shop_outbox VALUES (%s, 'Placed', 'c-9', 'Cart',"
        ' \'{"total": 12, "items": [{"sku": "x"}]}\', \'2024-05-01 10:00:00.123456\','
        " 'acme', %s)",
        (first, trace),
    )
    writer_db.execute(
        "INSERT INTO shop_outbox (uid, kind, entity, stream, body) VALUES"
        " (%s, 'Removed', 'c-9', 'Cart', NULL)",
        (gone,),
    )
    topic = f"{topic_prefix}shop.Cart.events"
    placed, removed = consume(kafka_bootstrap, [topic], 2, timeout=60)
    assert placed.key == b'"c-9"'  # JsonConverter keys are JSON
    assert json.loads(placed.value or b"") == {
        "payload": {"items": [{"sku": "x"}], "total": 12},
        "tenant": "acme",
        "kind": "Placed",
    }
    assert placed.headers == [
        ("id", str(first).encode()),
        ("eventType", b"Placed"),
        ("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]
    assert placed.timestamp_ms == 1714557600123  # 2024-05-01T10:00:00.123Z
    assert removed.value is None  # a tombstone for the empty payload
    assert removed.header("id") == str(gone).encode()


def test_the_partition_placement_chooses_the_partition_as_kafka_connect_does(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """Issue #33: table.fields.additional.placement=<integer column>:partition (Debezium's
    router sets the record's partition from it; a NULL leaves it to the partitioner).
    A partition the topic does not have is that row's poison, as its dead letter says."""
    db.execute(DEBEZIUM_TABLE)
    db.execute("ALTER TABLE outbox_events ADD COLUMN shard integer")
    attach(
        database_url,
        "outbox_events",
        route(topic_prefix),
        "table.fields.additional.placement=shard:partition",
    )
    grant_app(db, "outbox_events")
    dead = topic_prefix + "dead"
    start_relay(
        subscribers=[
            sub(
                "s",
                topic_prefix,
                value_format="debezium",
                on_poison="dead-letter",
                dead_letter_topic=dead,
            )
        ],
        topic_partitions=3,
    )
    rows = [("a", 2), ("b", 0), ("c", 1), ("d", 9), ("e", 2)]
    with writer_db.transaction():
        for key, shard in rows:
            writer_db.execute(
                "INSERT INTO outbox_events VALUES (%s, 'Order', %s, 't', '{}', %s)",
                (uuid.uuid4(), key, shard),
            )
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.Order"], 4, quiet=1.0)
    assert sorted((r.key, r.partition) for r in seen) == [
        (b"a", 2),
        (b"b", 0),
        (b"c", 1),
        (b"e", 2),
    ]
    (letter,) = consume(kafka_bootstrap, [dead], 1)
    assert "partition 9 does not exist" in (letter.header_text("outbox.error") or "")


def halted_error(db: psycopg.Connection[Any], name: str) -> str | None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        errors = [p.halted_error for p in OutboxStore(db).get(name).parts if p.halted_error]
        if errors:
            return errors[0]
        time.sleep(0.1)
    return None


def test_a_row_the_router_cannot_route_is_inserted_and_halts_the_subscriber_with_the_reason(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    topic_prefix: str,
    debezium_relay: Any,
) -> None:
    db.execute(
        "CREATE TABLE events (id uuid PRIMARY KEY, aggregatetype text, aggregateid text,"
        " type text, payload jsonb)"
    )
    attach(database_url, "events", route(topic_prefix))
    grant_app(db, "events")
    debezium_relay()
    event_id = uuid.uuid4()
    # The app's INSERT succeeds; Debezium would stop on this row, the relay halts.
    writer_db.execute("INSERT INTO events VALUES (%s, NULL, 'k', 't', '{}')", (event_id,))
    error = halted_error(db, "s")
    assert error is not None and str(event_id) in error
    assert "route.by.field is null" in error


def test_an_update_halts_the_subscriber_when_invalid_ops_are_fatal(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    database_url: str,
    topic_prefix: str,
    debezium_relay: Any,
) -> None:
    db.execute(DEBEZIUM_TABLE)
    attach(database_url, "outbox_events", route(topic_prefix), "table.op.invalid.behavior=fatal")
    grant_app(db, "outbox_events")
    debezium_relay()
    event_id = uuid.uuid4()
    writer_db.execute("INSERT INTO outbox_events VALUES (%s, 'Order', 'k', 't', '{}')", (event_id,))
    writer_db.execute("UPDATE outbox_events SET payload = '{\"x\": 1}'")
    error = halted_error(db, "s")
    assert error is not None and "table.op.invalid.behavior is fatal" in error


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["route.topic.regex=(.*)"], "route.topic.regex"),
        (["table.field.event.payload=body"], "has no column(s) ['body']"),
        (["table.fields.additional.placement=type:body"], "placement must be header"),
        (["table.fields.additional.placement=type:partition"], "from an `integer` column only"),
        (["value.converter=org.apache.kafka.connect.json.JsonConverter"], "schemas.enable=false"),
        (["no.such.option=1"], "unsupported Event Router option(s) ['no.such.option']"),
        (["table.field.event.key=created"], "['created (timestamp)'] are not supported"),
    ],
)
def test_attach_refuses_options_it_cannot_honour(
    db: psycopg.Connection[Any], database_url: str, options: list[str], message: str
) -> None:
    db.execute(DEBEZIUM_TABLE)
    db.execute("ALTER TABLE outbox_events ADD COLUMN created timestamp")
    args = [a for o in options for a in ("-o", o)]
    done = run_cli(
        "debezium", "attach", "outbox_events", *args, env={"RELAY_DATABASE_URL": database_url}
    )
    assert done.returncode != 0
    assert message in done.stderr


def test_attach_to_a_missing_table_is_a_configuration_error_naming_it(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    done = run_cli("debezium", "attach", "no_such_table", env={"RELAY_DATABASE_URL": database_url})
    assert done.returncode == 2
    assert 'configuration error: table "no_such_table" does not exist' in done.stderr


def test_verify_says_it_cannot_check_a_debezium_subscriber(
    relay_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    added = run_cli(
        "subscribers", "add", "dbz", "--format", "debezium",
        env={"RELAY_DATABASE_URL": relay_url},
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    named = run_cli("verify", "--subscriber", "dbz", env=env)
    assert named.returncode != 0
    assert "cannot verify ['dbz']: the debezium format carries no relay headers" in named.stderr
    everything = run_cli("verify", env=env)
    assert "not verified: subscriber dbz" in everything.stderr
