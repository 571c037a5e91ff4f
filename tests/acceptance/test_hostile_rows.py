"""Issue #17: an application that may only INSERT into the outbox must not be able to
harm publication for everyone else. Each test writes a hostile row, then an ordinary
one, against a real Postgres and Apache Kafka, and checks the ordinary one is published
while the hostile one goes where the subscriber's poison policy says."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import BEGINNING, PartId
from relay.core.ports import Selection
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from tests.support import (
    consume,
    keyed,
    keys,
    sub,
    wait_caught_up,
    wait_until,
    worker,
    write_orders,
)

StartRelay = Callable[..., Relay]


def insert(db: psycopg.Connection[Any], key: str, payload: str, **columns: Any) -> None:
    """A row as any application may write it in plain SQL."""
    row = {"aggregate_type": "order", "aggregate_id": key, "event_type": "Note",
           "payload": payload, **columns}  # fmt: skip
    db.execute(
        sql.SQL("INSERT INTO outbox ({}) VALUES ({})").format(
            sql.SQL(", ").join(map(sql.Identifier, row)),
            sql.SQL(", ").join(sql.Placeholder() * len(row)),
        ),
        list(row.values()),
    )


def json_subscribers(prefix: str) -> list[dict[str, Any]]:
    """One dead-letter and one halting subscriber, JSON values, routed by aggregate type."""
    return [
        sub("dl", prefix, value_format="json", on_poison="dead-letter",
            dead_letter_topic=prefix + "dead"),
        sub("halt", prefix + "h.", value_format="json"),
    ]  # fmt: skip


def test_rows_python_cannot_load_or_write_are_poison_not_a_silent_crash_loop(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Postgres accepts an integer of 5,001 digits and 1,020 levels of nesting; Python
    refuses to load the first and to write the second. Each is its row's poison."""
    write_orders(writer_db, outbox, ["before"])
    insert(writer_db, "huge", '{"n": 1e5000}')
    insert(writer_db, "deep", "[" * 1020 + "]" * 1020)
    insert(writer_db, "deep-header", "{}", headers='{"h": ' + "[" * 1020 + "]" * 1020 + "}")
    insert(writer_db, "forever", '{"ok": true}', occurred_at="infinity")  # legal: published
    write_orders(writer_db, outbox, ["after"])
    relay = start_relay(subscribers=json_subscribers(topic_prefix))

    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 3)
    assert keys(seen) == ["after", "before", "forever"]
    dead = keyed(consume(kafka_bootstrap, [topic_prefix + "dead"], 3))
    assert sorted(dead) == ["deep", "deep-header", "huge"]
    assert "digits" in dead["huge"].header_text("outbox.error")
    assert "Recursion" in dead["deep"].header_text("outbox.error")
    assert "Recursion" in dead["deep-header"].header_text("outbox.error")
    assert "payload_omitted" in json.loads(dead["huge"].value or b"")

    wait_until(lambda: worker(relay, "halt").stats.state is WorkerState.HALTED, what="halt")
    halted = OutboxStore(db).get_part("halt", 0)
    assert halted.halted_error is not None and "digits" in halted.halted_error
    for name in ("dl", "halt"):
        stats = worker(relay, name).stats
        assert stats.unexpected == 0 and stats.poisoned >= 1
        assert worker(relay, name).is_alive() or stats.state is WorkerState.HALTED


def test_forged_ordering_keys_are_replaced_so_every_row_is_published(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """The table's owner may name transaction_id and position (OVERRIDING SYSTEM VALUE).
    A key below the checkpoint used to be skipped; one of 2^62 or 2^64-1 kept its row
    pending for ever. The outbox now assigns both, whatever the writer says."""
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    write_orders(writer_db, outbox, ["first"])
    wait_caught_up(db, "s")  # the checkpoint is past transaction id 5 now
    for key, forged in (("below", 5), ("far", 2**62), ("last", 2**64 - 1)):
        db.execute(  # the owner: a writer role may not name either column
            "INSERT INTO outbox (transaction_id, position, aggregate_type, aggregate_id,"
            " event_type, payload) OVERRIDING SYSTEM VALUE"
            " VALUES (%s::text::xid8, 1, 'order', %s, 'Note', '{}')",
            (str(forged), key),
        )
    write_orders(writer_db, outbox, ["after"])

    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 5)
    assert keys(seen) == ["after", "below", "far", "first", "last"]
    wait_caught_up(db, "s")  # nothing left pending: no false lag
    positions = db.execute("SELECT position FROM outbox ORDER BY transaction_id, position")
    assert len({p for (p,) in positions}) == 5  # no forged position 1 left


def test_topics_kafka_refuses_are_the_rows_poison_and_others_flow(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """With a topic template, writers name topics. Apache Kafka refuses '.' and '..',
    and a name that collides with an existing one on '.' against '_'. Creating the
    topic used to fail the part for good, under any policy."""
    subscribers = [
        sub("dl", "", topic=topic_prefix + "{aggregate_type}", value_format="json",
            on_poison="dead-letter", dead_letter_topic=topic_prefix + "dead"),
        sub("dots", "", topic="{aggregate_type}", aggregate_types=[".", ".."],
            value_format="json", on_poison="dead-letter",
            dead_letter_topic=topic_prefix + "dead.dots"),
    ]  # fmt: skip
    insert(writer_db, "under", "{}", aggregate_type="a_b")
    start_relay(subscribers=subscribers)
    consume(kafka_bootstrap, [topic_prefix + "a_b"], 1)  # it exists now
    for key, aggregate_type in (("dot", "a.b"), ("one", "."), ("two", "..")):
        insert(writer_db, key, "{}", aggregate_type=aggregate_type)
    write_orders(writer_db, outbox, ["after"])

    [after] = consume(kafka_bootstrap, [topic_prefix + "order"], 1)
    assert after.key == b"after"
    [collided] = consume(kafka_bootstrap, [topic_prefix + "dead"], 1)
    assert collided.key == b"dot" and "collides" in collided.header_text("outbox.error")
    illegal = consume(kafka_bootstrap, [topic_prefix + "dead.dots"], 2)
    assert keys(illegal) == ["one", "two"]
    assert all("not a legal Kafka topic name" in r.header_text("outbox.error") for r in illegal)


def test_rows_cannot_reach_internal_checkpoint_dead_letter_or_others_topics(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Routed by '{aggregate_type}', writer rows used to land in __consumer_offsets, the
    checkpoint topic and another subscriber's dead-letter topic, one carrying a forged
    outbox.error header."""
    wild_types = [
        "__consumer_offsets",
        "outbox-relay.checkpoints",  # the relay's checkpoint topic (the default name)
        topic_prefix + "dead",  # subscriber "fixed"'s dead-letter topic
        topic_prefix + "fixed",  # subscriber "fixed"'s own topic
        topic_prefix + "mine",  # an ordinary topic: published
    ]
    subscribers = [
        sub("wild", "", topic="{aggregate_type}", aggregate_types=wild_types,
            value_format="json", on_poison="dead-letter",
            dead_letter_topic=topic_prefix + "dead.wild"),
        sub("fixed", "", topic=topic_prefix + "fixed", aggregate_types=["order"],
            value_format="json", on_poison="dead-letter",
            dead_letter_topic=topic_prefix + "dead"),
    ]  # fmt: skip
    for aggregate_type in wild_types:
        headers = '{"outbox.error": "forged", "trace": "t-1"}'
        insert(writer_db, aggregate_type, "{}", aggregate_type=aggregate_type, headers=headers)
    write_orders(writer_db, outbox, ["after"])
    start_relay(subscribers=subscribers)

    [after] = consume(kafka_bootstrap, [topic_prefix + "fixed"], 1)
    assert after.key == b"after"
    [mine] = consume(kafka_bootstrap, [topic_prefix + "mine"], 1)
    assert mine.header_text("trace") == "t-1" and mine.header("outbox.error") is None
    refused = keyed(consume(kafka_bootstrap, [topic_prefix + "dead.wild"], 4))
    assert sorted(refused) == sorted(wild_types[:4])
    reasons = {key: r.header_text("outbox.error") for key, r in refused.items()}
    assert "internal" in reasons["__consumer_offsets"]
    assert "checkpoint topic" in reasons["outbox-relay.checkpoints"]
    assert "dead-letter topic" in reasons[topic_prefix + "dead"]
    assert "'fixed'" in reasons[topic_prefix + "fixed"]
    assert all(r.header_text("outbox.error") != "forged" for r in refused.values())


def test_rows_beyond_the_topic_cap_wait_for_room_across_restarts_and_are_never_poison(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """One INSERT of many aggregate types used to create as many topics; then the rows
    beyond max_created_topics were poison, a legal row's fault (issue #47). A full
    budget is the relay's configuration: the part waits, alerted, and goes on once there
    is room. The count is the outbox's, in Postgres: it holds across restarts, workers
    and replicas (it used to be per process, issue #27)."""
    settings: dict[str, Any] = {
        "max_created_topics": 2,
        "subscribers": [
            sub("s", "", topic=topic_prefix + "{aggregate_type}", value_format="json",
                on_poison="dead-letter", dead_letter_topic=topic_prefix + "dead"),
        ],
    }  # fmt: skip
    with writer_db.transaction():
        for aggregate_type in ("first", "second"):
            insert(writer_db, aggregate_type, "{}", aggregate_type=aggregate_type)
    first = start_relay(**settings)
    created = [topic_prefix + "first", topic_prefix + "second"]
    assert keys(consume(kafka_bootstrap, created, 2)) == ["first", "second"]
    first.stop()
    relay = start_relay(**settings)  # a restart, or another replica: the cap is reached
    insert(writer_db, "third", "{}", aggregate_type="third")
    insert(writer_db, "again", "{}", aggregate_type="first")
    part = PartId("s", 0)
    wait_until(lambda: relay.part_waits().get(part) == "topic_budget", what="waiting for room")
    assert worker(relay, "s").stats.poisoned == 0
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)
    relay.stop()
    start_relay(**{**settings, "max_created_topics": 3})  # room for one more
    assert keys(consume(kafka_bootstrap, [topic_prefix + "third"], 1)) == ["third"]
    assert keys(consume(kafka_bootstrap, created, 3)) == ["again", "first", "second"]


def test_without_topic_creation_a_row_naming_a_missing_topic_is_poison_not_a_stall(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """With create_topics = false, a row whose aggregate type names no existing topic
    used to fail its batch until the delivery timeout, then again, for ever, holding
    back every later row of the part."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    checkpoints, existing, dead = (
        "outbox-relay.checkpoints",
        topic_prefix + "order",
        topic_prefix + "dead",
    )
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    wanted = [NewTopic(checkpoints, 2, 1, config={"cleanup.policy": "compact"}),
              NewTopic(existing, 1, 1), NewTopic(dead, 1, 1)]  # fmt: skip
    for future in admin.create_topics(wanted).values():
        try:
            future.result(30)
        except Exception as exc:  # the session's broker may have the checkpoint topic
            assert "already exists" in str(exc)
    insert(writer_db, "nowhere", "{}", aggregate_type="no-such-type")
    write_orders(writer_db, outbox, ["after"])
    start_relay(
        create_topics=False,
        # The operator made the topics: naming them lets rows reach them (issue #47).
        topic_allow=re.escape(topic_prefix) + ".*",
        delivery_timeout=5,
        subscribers=[
            sub("s", "", topic=topic_prefix + "{aggregate_type}", value_format="json",
                on_poison="dead-letter", dead_letter_topic=dead),
        ],
    )  # fmt: skip
    [after] = consume(kafka_bootstrap, [existing], 1)
    assert after.key == b"after"
    [refused] = consume(kafka_bootstrap, [dead], 1)
    assert refused.key == b"nowhere"
    assert "does not exist and create_topics is false" in refused.header_text("outbox.error")


def test_a_batch_stops_once_its_rows_reach_batch_max_bytes_and_holds_at_least_one(
    relay_db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
) -> None:
    for n in range(5):  # about 100 KB each, incompressible: stored at full size
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', %s, 'Note', jsonb_build_object('blob',"
            " (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 3200)))",
            (f"big-{n}",),
        )
    store = OutboxStore(relay_db)
    every = store.fetch(BEGINNING, Selection(100)).events
    sizes = [e.stored_bytes for e in every]
    assert len(every) == 5 and all(size > 100_000 for size in sizes)

    two = store.fetch(BEGINNING, Selection(100, max_bytes=sizes[0] + sizes[1])).events
    assert [e.aggregate_id for e in two] == ["big-0", "big-1"]
    rest = store.fetch(two[-1].key, Selection(100, max_bytes=sizes[2] + 1)).events
    assert [e.aggregate_id for e in rest] == ["big-2", "big-3"]  # the one that crosses it
    assert [e.aggregate_id for e in store.fetch(BEGINNING, Selection(100, max_bytes=1)).events] == [
        "big-0"
    ]
    assert (
        len(store.fetch(BEGINNING, Selection(3, max_bytes=2**40)).events) == 3
    )  # the row cap still holds


def test_large_rows_go_out_in_batches_under_batch_max_bytes_and_others_follow(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Legal rows of 300 KB each, six of them: one batch of six used to hold them all in
    memory at once; under a 700 KB cap they go out in batches of three."""
    for n in range(6):
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', %s, 'Note', jsonb_build_object('blob',"
            " (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 9400)))",
            (f"big-{n}",),
        )
    write_orders(writer_db, outbox, ["after"])
    relay = start_relay(
        batch_max_bytes=700_000, subscribers=[sub("s", topic_prefix, value_format="json")]
    )
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 7)
    assert keys(seen) == sorted([f"big-{n}" for n in range(6)] + ["after"])
    assert worker(relay, "s").stats.batches >= 2  # 1 without the byte cap
