"""The relay against a real Postgres and a real broker, judged by what a consumer sees."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from relay import Event, Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import ConsumedRecord, PartId
from relay.core.schemas import SchemaFolder
from relay.core.subscribers import StartFrom, Subscriber
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from tests.support import by_key, consume, keys, nothing_arrives, order, sub, worker, write_orders

StartRelay = Callable[..., Relay]


def payload_ids(seen: list[ConsumedRecord], registry: SchemaFolder) -> list[str]:
    return [registry.decode(s.value or b"")[1]["order_id"] for s in seen]


def test_published_records_carry_key_headers_and_self_describing_avro(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    with writer_db.transaction():
        message_id = outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-7",
            event_type="OrderPlaced",
            payload=order(7),
            headers={"traceparent": "00-1-2-01"},
        )
        xid = writer_db.execute("SELECT pg_current_xact_id()::text").fetchone()
    start_relay(subscribers=[sub("s", topic_prefix)])
    [record] = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 1)
    assert record.key == b"o-7"
    assert record.message_id == str(message_id)
    assert record.header_text("event_type") == "OrderPlaced"
    assert record.header_text("aggregate_type") == "order"
    assert record.header_text("transaction_id") == xid[0]  # type: ignore[index]
    assert record.position is not None and record.position.position >= 1
    assert record.header_text("traceparent") == "00-1-2-01"
    writer, value = registry.decode(record.value or b"")
    assert writer.full_name == "demo.orders.OrderPlaced"
    assert value == {**order(7), "currency": "EUR", "note": None}


def test_an_older_transaction_committing_last_is_not_skipped(
    writer_url: str,
    db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    start_relay(subscribers=[sub("s", topic_prefix)])
    # A first event makes the topic exist and shows the relay publishing, so the quiet
    # window below is one in which the relay could have published the younger events.
    with psycopg.connect(writer_url) as primer:  # commits on leaving
        write_orders(primer, outbox, ["primer"])
    consume(kafka_bootstrap, [topic], 1)
    with psycopg.connect(writer_url) as older, psycopg.connect(writer_url) as younger:
        write_orders(older, outbox, ["old-1"])  # takes the smaller xid and a position
        write_orders(younger, outbox, ["young-1", "young-2"])
        younger.commit()  # the younger commits first...
        held_back = nothing_arrives(kafka_bootstrap, [topic], within=1.5)
        assert payload_ids(held_back, registry) == ["primer"]  # ...and is held back
        older.commit()
    seen = consume(kafka_bootstrap, [topic], 4)
    assert sorted(payload_ids(seen, registry)) == ["old-1", "primer", "young-1", "young-2"]


def test_rolled_back_events_are_never_published(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)])
    for i in range(20):
        with writer_db.transaction():
            write_orders(writer_db, outbox, [f"kept-{i}"])
        with writer_db.transaction():
            write_orders(writer_db, outbox, [f"rolled-{i}"])
            raise psycopg.Rollback()
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 20)
    assert sorted(payload_ids(seen, registry)) == sorted(f"kept-{i}" for i in range(20))


def test_many_events_in_one_transaction_keep_their_order(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    ids = [f"o-{i}" for i in range(2500)]
    with writer_db.transaction():
        # Interleave five keys inside one large transaction (more than one relay batch).
        for n, i in enumerate(ids):
            outbox.append(
                writer_db,
                aggregate_type="order",
                aggregate_id=f"k{n % 5}",
                event_type="OrderPlaced",
                payload=order(i),
            )
    start_relay(subscribers=[sub("s", topic_prefix)], batch_size=400)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], len(ids), timeout=60)
    assert len(seen) == len(ids)
    for key, records in by_key(seen).items():
        expected = [i for n, i in enumerate(ids) if f"k{n % 5}" == key]
        assert payload_ids(records, registry) == expected


def test_a_long_open_transaction_holds_the_relay_back_until_it_commits(
    database_url: str,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    with psycopg.connect(database_url) as long_tx:
        long_tx.execute("SELECT pg_current_xact_id()")  # holds the horizon, writes nothing
        with writer_db.transaction():
            write_orders(writer_db, outbox, ["a", "b", "c"])
        assert nothing_arrives(kafka_bootstrap, [topic], within=2.0) == []
        assert worker(relay, "s").stats.published == 0
        long_tx.commit()  # no outbox write, so no NOTIFY: the timer must pick it up
    seen = consume(kafka_bootstrap, [topic], 3)
    assert len(seen) == 3


def test_a_restarted_relay_resumes_from_its_checkpoint(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    first = start_relay(subscribers=[sub("s", topic_prefix)])
    with writer_db.transaction():
        write_orders(writer_db, outbox, [f"first-{i}" for i in range(50)], key="same")
    assert len(consume(kafka_bootstrap, [topic], 50, quiet=0.2)) == 50
    first.stop()
    with writer_db.transaction():
        write_orders(writer_db, outbox, [f"second-{i}" for i in range(50)], key="same")
    start_relay(subscribers=[sub("s", topic_prefix)])
    seen = consume(kafka_bootstrap, [topic], 100)
    expected = [f"first-{i}" for i in range(50)] + [f"second-{i}" for i in range(50)]
    assert payload_ids(by_key(seen)["same"], registry) == expected  # each once, in order


def test_two_subscribers_with_different_filters_routes_and_formats(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    with writer_db.transaction():
        write_orders(writer_db, outbox, ["o-1", "o-2"])
        outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            event_type="OrderShipped",
            payload={"order_id": "o-1", "carrier": "dhl"},
        )
        outbox.append(
            writer_db,
            aggregate_type="customer",
            aggregate_id="c-1",
            event_type="CustomerRegistered",
            payload={"customer_id": "c-1", "email": "a@b.c"},
        )
    start_relay(
        subscribers=[
            sub("orders-json", topic_prefix + "a.", aggregate_types=["order"], value_format="json"),
            {
                "name": "shipments",
                "topic": topic_prefix + "b.{event_type}",
                "event_types": ["OrderShipped"],
            },
        ]
    )
    orders = consume(kafka_bootstrap, [topic_prefix + "a.outbox.event.order"], 3)
    assert sorted(json.loads(s.value)["order_id"] for s in orders) == ["o-1", "o-1", "o-2"]
    shipped = consume(kafka_bootstrap, [topic_prefix + "b.OrderShipped"], 1)
    assert [s.header_text("event_type") for s in shipped] == ["OrderShipped"]
    assert (
        nothing_arrives(kafka_bootstrap, [topic_prefix + "a.outbox.event.customer"], within=0.5)
        == []
    )


def test_a_part_that_drained_its_backlog_is_woken_by_the_probe_not_its_timer(
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    """The commit probe looks only while a part waits for news (#31). While the part
    drains its backlog the probe rests; once it has caught up, a new commit still
    reaches Kafka, though the part's own poll timer is five minutes away."""
    write_orders(writer_db, outbox, [f"o-{n}" for n in range(50)])
    start_relay(subscribers=[sub("s", topic_prefix)], poll_interval=300, batch_size=10)
    topics = [topic_prefix + "outbox.event.order"]
    assert len(consume(kafka_bootstrap, topics, 50)) == 50
    write_orders(writer_db, outbox, ["late"])
    assert "late" in keys(consume(kafka_bootstrap, topics, 51))


def test_a_subscriber_of_one_type_reads_past_other_types_and_rests_when_idle(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    """Its fetch reads only its own rows (an index), yet its checkpoint moves past the
    rows of other types, and once everything is read it writes no checkpoint at all."""
    start_relay(subscribers=[sub("orders", topic_prefix, aggregate_types=["order"])])
    write_orders(writer_db, outbox, ["o-1"])
    for n in range(3):  # later rows, none of them the subscriber's
        outbox.append(
            writer_db,
            aggregate_type="customer",
            aggregate_id=f"c-{n}",
            event_type="CustomerRegistered",
            payload={"customer_id": f"c-{n}", "email": "a@b.c"},
        )
    assert keys(consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 1)) == ["o-1"]
    last = db.execute(
        "SELECT transaction_id, position FROM outbox"
        " ORDER BY transaction_id DESC, position DESC LIMIT 1"
    ).fetchone()
    past = "SELECT (transaction_id, position) >= (%s, %s), version FROM outbox_checkpoints"
    deadline = time.monotonic() + 60
    while not (row := db.execute(past, last).fetchone())[0]:
        assert time.monotonic() < deadline, "the checkpoint never passed the other types' rows"
        time.sleep(0.1)
    time.sleep(3)  # idle: polls and probe ticks, no new rows
    assert db.execute(past, last).fetchone() == row


def test_event_sourced_versions_arrive_in_version_order(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)])
    version = 0
    for i in range(10):
        with writer_db.transaction():
            events = [
                Event("OrderShipped", {"order_id": "o-1", "carrier": f"c{i}-{j}"}) for j in range(3)
            ]
            version = outbox.append_to_stream(
                writer_db,
                aggregate_type="order",
                aggregate_id="o-1",
                expected_version=version,
                events=events,
            ).version
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 30)
    assert [int(s.header_text("aggregate_version")) for s in by_key(seen)["o-1"]] == list(
        range(1, 31)
    )


def test_a_halted_subscriber_does_not_stall_the_others(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    with writer_db.transaction():
        write_orders(writer_db, outbox, ["o-1"])
        # Written by plain SQL with no Avro schema: the Avro subscriber cannot encode it.
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'x', 'Unknown', '{}')"
        )
        write_orders(writer_db, outbox, ["o-2"])
    relay = start_relay(
        subscribers=[
            sub("avro", topic_prefix + "avro."),
            sub("json", topic_prefix + "json.", value_format="json"),
        ]
    )
    seen = consume(kafka_bootstrap, [topic_prefix + "json.outbox.event.order"], 3)
    assert len(seen) == 3
    deadline = time.monotonic() + 60
    while (
        worker(relay, "avro").stats.state is not WorkerState.HALTED and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    stats = worker(relay, "avro").stats
    assert stats.state is WorkerState.HALTED
    assert "Unknown" in (stats.last_error or "")
    # Its checkpoint stays before the poison batch, so nothing is lost when it is fixed.
    assert (
        nothing_arrives(kafka_bootstrap, [topic_prefix + "avro.outbox.event.order"], within=0.5)
        == []
    )
    assert worker(relay, "json").stats.state is WorkerState.RUNNING


def test_new_subscriber_from_now_skips_history_and_default_routes_everything(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    aggregate = topic_prefix.strip(".")  # unique aggregate type: the default topic is shared

    def write(i: int) -> None:
        outbox.append(
            writer_db,
            aggregate_type=aggregate,
            aggregate_id=str(i),
            event_type="OrderPlaced",
            payload=order(i),
        )

    write(1)
    relay = start_relay()  # no subscriber configured: the default subscriber routes everything
    consume(kafka_bootstrap, [f"outbox.event.{aggregate}"], 1, quiet=0.1)
    # Added at run time (as `outbox-relay subscribers add --from now` does); picked up live.
    OutboxStore(db).add(
        Subscriber("late", topic=topic_prefix + "outbox.event.{aggregate_type}"), StartFrom.NOW
    )
    deadline = time.monotonic() + 60
    while PartId("late", 0) not in relay.workers and time.monotonic() < deadline:
        time.sleep(0.1)
    write(2)
    seen = consume(kafka_bootstrap, [topic_prefix + f"outbox.event.{aggregate}"], 1)
    assert [s.key for s in seen] == [b"2"]
    everything = consume(kafka_bootstrap, [f"outbox.event.{aggregate}"], 2)
    assert keys(everything) == ["1", "2"]


def test_pause_and_reset_take_effect_on_a_running_relay(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    write_orders(writer_db, outbox, ["1"])
    consume(kafka_bootstrap, [topic], 1, quiet=0.1)
    store = OutboxStore(db)
    store.set_paused("s", True)
    deadline = time.monotonic() + 60
    while worker(relay, "s").stats.state is not WorkerState.PAUSED and time.monotonic() < deadline:
        time.sleep(0.05)
    write_orders(writer_db, outbox, ["2"])
    assert [s.key for s in consume(kafka_bootstrap, [topic], 1, quiet=1.5)] == [b"1"]  # not "2"
    store.reset("s", StartFrom.BEGINNING)
    store.set_paused("s", False)
    seen = consume(kafka_bootstrap, [topic], 3)
    assert keys(seen) == ["1", "1", "2"]  # replayed from the beginning


@pytest.mark.parametrize("writers", [4])
def test_concurrent_writers_with_rollbacks_every_committed_event_once_in_key_order(
    writer_url: str,
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
    writers: int,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)], batch_size=100)
    committed: list[list[str]] = [[] for _ in range(writers)]

    def write(w: int) -> None:
        with psycopg.connect(writer_url) as conn:
            for i in range(100):
                ids = [f"w{w}-{i}-{j}" for j in range(3)]
                write_orders(conn, outbox, ids, key=f"w{w}")
                if i % 7 == 3:
                    conn.rollback()
                else:
                    conn.commit()
                    committed[w].extend(ids)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(len(c) for c in committed)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], total, timeout=60)
    assert len(seen) == total
    groups = by_key(seen)
    for w in range(writers):
        assert payload_ids(groups[f"w{w}"], registry) == committed[w]


def test_a_consumer_group_with_subscribe_reads_every_event_once_in_key_order(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    start_relay: StartRelay,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    """How apps consume: two members of one group, subscribe(), read_committed, committing
    offsets. Between them they see each event once, each key in the order written."""
    from confluent_kafka import Consumer

    topic = topic_prefix + "outbox.event.order"
    ids = [f"{k}-{i}" for i in range(30) for k in ("a", "b", "c", "d")]
    with writer_db.transaction():
        for i in ids:
            write_orders(writer_db, outbox, [i], key=i.split("-")[0])
    start_relay(subscribers=[sub("s", topic_prefix)])
    consume(kafka_bootstrap, [topic], len(ids))  # published
    group = f"app-{topic_prefix}"
    members = [
        Consumer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "group.id": group,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
            }
        )
        for _ in range(2)
    ]
    seen: list[tuple[str, str]] = []
    try:
        for member in members:
            member.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(seen) < len(ids) and time.monotonic() < deadline:
            for member in members:
                message = member.poll(0.2)
                if message is not None and message.error() is None:
                    headers = dict(message.headers() or [])
                    seen.append((message.key().decode(), headers["id"].decode()))
    finally:
        for member in members:
            member.close()
    written = db.execute(
        "SELECT aggregate_id, message_id::text FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    assert len(seen) == len(written) == len({i for _, i in seen})
    assert _per_key(seen) == _per_key(written)


def _per_key(pairs: list[tuple[str, str]]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for key, message_id in pairs:
        grouped.setdefault(key, []).append(message_id)
    return grouped
