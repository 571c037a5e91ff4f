"""Issue #27: a writer cannot halt a dead-letter subscriber, and a dead-letter decision is
recorded only together with its record on the topic. Real Postgres and Apache Kafka."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.daemon import Relay
from tests.support import consume, keyed, keys, sub, wait_caught_up, wait_until, write_orders

StartRelay = Callable[..., Relay]


def _dead_lettered(db: psycopg.Connection[Any], name: str) -> list[str]:
    rows = db.execute(
        "SELECT message_id::text FROM outbox_dead_letters WHERE subscriber = %s", (name,)
    ).fetchall()
    return [row[0] for row in rows]


def test_a_row_with_huge_columns_is_dead_lettered_small_and_publication_goes_on(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """A 600 KB aggregate_id and event type make the row's record too large; its dead
    letter used to copy both whole, was refused too, and halted the part. Migration 0008
    limits both columns for new rows, NOT VALID: a row written before it may still hold
    them, so the owner drops the limits to write one as such a writer did."""
    dead = topic_prefix + "dead"
    write_orders(writer_db, outbox, ["before"])
    db.execute(
        "ALTER TABLE outbox DROP CONSTRAINT outbox_aggregate_id_length,"
        " DROP CONSTRAINT outbox_event_type_length, DROP CONSTRAINT outbox_headers_size"
    )
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)"
        " VALUES ('order', repeat('k', 600000), repeat('E', 600000), '{}',"
        "         jsonb_build_object('h', repeat('v', 300000)))"
    )
    write_orders(writer_db, outbox, ["after"])
    start_relay(
        subscribers=[
            sub(
                "dl",
                topic_prefix,
                value_format="json",
                on_poison="dead-letter",
                dead_letter_topic=dead,
            ),
        ]
    )
    wait_caught_up(db, "dl", timeout=60)
    assert OutboxStore(db).get_part("dl", 0).halted_error is None
    assert keys(consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 2)) == [
        "after",
        "before",
    ]
    [letter] = consume(kafka_bootstrap, [dead], 1)
    document = json.loads(letter.value or b"")
    assert document["aggregate_id"].endswith("...[cut: 600000 bytes]")
    assert document["event_type"].endswith("...[cut: 600000 bytes]")
    assert "headers_omitted_bytes" in document
    assert "too large" in (letter.header_text("outbox.error") or "")
    assert _dead_lettered(db, "dl") == [letter.message_id]


def test_a_decision_is_recorded_only_with_its_dead_letter_on_the_topic(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Records are refused beyond message.max.bytes. Where the event's identity still
    fits, its dead letter goes there and publication goes on; where nothing fits, the
    part halts and no decision is recorded: its Kafka transaction was aborted. (The
    decision used to be recorded before the transaction: dead-lettered, but on no topic.)"""
    # Poison: its aggregate type routes to an illegal topic name (quoted in the error).
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " VALUES ('no such type! ' || repeat('x', 200), 'bad', 'Note',"
        "         jsonb_build_object('blob', repeat('x', 5000)))"
    )
    write_orders(writer_db, outbox, ["after"])
    roomy, tiny = topic_prefix + "dead.roomy", topic_prefix + "dead.tiny"
    first = start_relay(
        kafka={"message.max.bytes": 4000},
        subscribers=[
            sub("roomy", topic_prefix + "r.", value_format="json", on_poison="dead-letter",
                dead_letter_topic=roomy),
        ],
    )  # fmt: skip
    wait_caught_up(db, "roomy", timeout=60)
    first.stop()
    [letter] = consume(kafka_bootstrap, [roomy], 1)
    assert json.loads(letter.value or b"")["omitted"].startswith("payload and headers")
    assert _dead_lettered(db, "roomy") == [letter.message_id]

    start_relay(
        kafka={"message.max.bytes": 1000},  # the least librdkafka takes
        subscribers=[
            sub("tiny", topic_prefix + "t.", value_format="json", on_poison="dead-letter",
                dead_letter_topic=tiny),
        ],
    )  # fmt: skip
    store = OutboxStore(db)
    wait_until(lambda: store.get_part("tiny", 0).halted_error is not None, timeout=60)
    assert "dead-letter record rejected" in (store.get_part("tiny", 0).halted_error or "")
    assert _dead_lettered(db, "tiny") == []


def test_a_number_beyond_a_double_is_dead_lettered_not_published_as_null(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """jsonb's numeric holds 1e400 + 0.5; Python loaded it as inf, written as null."""
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES"
        " ('order', 'fraction', 'Note', jsonb_build_object('n', 1e400::numeric + 0.5)),"
        " ('order', 'integer', 'Note', '{\"n\": 1e400}')"
    )
    write_orders(writer_db, outbox, ["after"])
    dead = topic_prefix + "dead"
    start_relay(
        subscribers=[
            sub("dl", topic_prefix, value_format="json", on_poison="dead-letter",
                dead_letter_topic=dead),
        ],
    )  # fmt: skip
    published = keyed(consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 2))
    assert sorted(published) == ["after", "integer"]
    assert published["integer"].value == b'{"n":1' + b"0" * 400 + b"}"  # exact, as stored
    [letter] = consume(kafka_bootstrap, [dead], 1)
    assert letter.key == b"fraction"
    assert "beyond a double" in (letter.header_text("outbox.error") or "")
