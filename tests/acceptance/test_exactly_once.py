"""Exactly-once publication: Kafka-side recovery, fencing, CAS checkpoints, HA, poison
events, graceful shutdown and ``verify``, against a real Postgres and a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import PartId, Position
from relay.core.ports import Batch, Selection
from relay.core.settings import load_settings
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from relay.errors import CheckpointConflict, ProducerFenced
from tests.support import (
    by_key,
    caught_up,
    consume,
    ids_of,
    run_cli,
    sub,
    unstarted_publishers,
    wait_until,
    worker,
    write_orders,
)

StartRelay = Callable[..., Relay]
REPO = Path(__file__).resolve().parents[2]


def test_a_commit_that_reached_kafka_but_not_postgres_is_adopted_not_republished(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """The crash window between the Kafka commit and the checkpoint update (docs/design.md §5)."""
    store = OutboxStore(relay_db)  # the doomed relay's
    store.add(
        Subscriber(
            "s", topic=topic_prefix + "outbox.event.{aggregate_type}", value_format=ValueFormat.JSON
        )
    )
    write_orders(writer_db, outbox, [f"o-{i}" for i in range(5)])
    # Play a relay that commits one batch to Kafka and dies before touching Postgres.
    settings = load_settings(database_url=relay_url, bootstrap_servers=kafka_bootstrap)
    doomed = Relay(settings)
    session = store.open_session("doomed", 1, 30)
    assert store.claim("s", 0, session)
    state = store.get_part("s", 0)
    publisher = unstarted_publishers(doomed, relay_db)(state)
    assert publisher.recover(str(state.generation)) is None
    events = store.fetch(state.checkpoint, Selection(100)).events
    records = [doomed.encoder.encode(e, state.subscriber) for e in events]
    publisher.publish(Batch(records, events[-1].key, str(state.generation)))
    publisher.close()
    store.close_session(session)  # its claim is free; Postgres still says "nothing published"
    assert store.get_part("s", 0).checkpoint == Position(0, 0)

    relay = start_relay()
    write_orders(writer_db, outbox, ["o-5", "o-6"])
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 7)
    assert Counter(ids_of(seen)).most_common(1)[0][1] == 1, "an event was published twice"
    assert len(seen) == 7
    assert worker(relay, "s").stats.recovered == 1


def test_a_checkpoint_postgres_lost_is_adopted_from_kafka_not_republished(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Transactional delivery commits the Postgres checkpoint with synchronous_commit
    off (docs/design.md §5): a crash of Postgres may lose the last ones, leaving an
    earlier checkpoint of the same generation under a running relay. The relay
    recovers from the Kafka-side checkpoint: every event once, in key order."""
    relay = start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    written = _publish_then_lose_the_last_advances(db, writer_db, outbox)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 13)
    assert Counter(ids_of(seen)).most_common(1)[0][1] == 1, "an event was published twice"
    assert len(seen) == 13
    in_order = {key: [m for k, m in written if k == key] for key in ("k0", "k1")}
    assert {k: ids_of(records) for k, records in by_key(seen).items()} == in_order
    assert worker(relay, "s").stats.recovered == 1


def test_an_idempotent_relay_publishes_again_from_a_checkpoint_postgres_lost(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Idempotent delivery has no Kafka-side checkpoint, yet commits the Postgres one
    with synchronous_commit off too (issue #31): a crash of Postgres may lose the last
    ones. The relay then publishes again from the earlier checkpoint it finds: at least
    once, nothing lost, and each key's last copies in the database's order."""
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")], delivery="idempotent")
    written = _publish_then_lose_the_last_advances(db, writer_db, outbox)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 20)
    counts = Counter(ids_of(seen))
    assert set(counts) == {m for _, m in written}, "an event was lost"
    # Only what the lost checkpoints covered came twice (the rows after OFFSET 4).
    assert sorted(counts.values()) == [1] * 6 + [2] * 7
    for key, records in by_key(seen).items():
        last_copies = list(dict.fromkeys(reversed(ids_of(records))))[::-1]
        assert last_copies == [m for k, m in written if k == key]


@pytest.mark.parametrize("delivery", ["transactional", "idempotent"])
def test_the_checkpoint_waits_for_the_wal_flush_only_with_dead_letters(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: StartRelay,
    delivery: str,
) -> None:
    """Each checkpoint's transaction runs with synchronous_commit off, as a trigger of
    the owner's sees it (the server's default is on), in both delivery modes; one that
    records a dead letter waits for the flush."""
    assert db.execute("SHOW synchronous_commit").fetchone() == ("on",)
    db.execute(COMMIT_MODES)
    dead = sub("s", topic_prefix, on_poison="dead-letter", dead_letter_topic=topic_prefix + "dead")
    relay = start_relay(subscribers=[dead], delivery=delivery)
    write_orders(writer_db, outbox, [f"o-{i}" for i in range(5)])
    wait_until(lambda: caught_up(db, "s"), what="the relay to publish")
    writer_db.execute(  # no Avro schema for this type: dead-lettered
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', 'x', 'Unknown', '{}')"
    )
    wait_until(lambda: caught_up(db, "s"), what="the relay to dead-letter the event")
    relay.stop()
    modes = [m for (m,) in db.execute("SELECT setting FROM advance_commit_modes").fetchall()]
    assert modes[-1] == "on" and set(modes[:-1]) == {"off"}


def _publish_then_lose_the_last_advances(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], outbox: Outbox
) -> list[tuple[str, str]]:
    """Have the running relay publish 12 events on two keys, then, as the owner, play a
    crash of Postgres that lost the part's last advances (position and version): it
    says the last 7 are not published yet. Once the relay is back at the end, one more
    event; returns every row's (key, message id) in the database's order."""
    for n in range(4):
        write_orders(writer_db, outbox, [f"o-{n}-{k}" for k in "abc"], key=f"k{n % 2}")
    wait_until(lambda: caught_up(db, "s"), what="the relay to publish")
    [end] = db.execute(CHECKPOINT).fetchall()
    db.execute(
        "UPDATE outbox_checkpoints SET (transaction_id, position) = "
        "(SELECT transaction_id, position FROM outbox ORDER BY transaction_id, position "
        "OFFSET 4 LIMIT 1), version = version - 1 WHERE subscriber = 's'"
    )
    # Back at the end only once the idle relay noticed: no new event wakes it.
    wait_until(lambda: db.execute(CHECKPOINT).fetchall() == [end], what="the relay to notice")
    write_orders(writer_db, outbox, ["o-later"], key="k0")
    wait_until(lambda: caught_up(db, "s"), what="the later event")
    return [
        (k, m)
        for k, m in db.execute(
            "SELECT aggregate_id, message_id::text FROM outbox ORDER BY transaction_id, position"
        ).fetchall()
    ]


CHECKPOINT = "SELECT transaction_id::text, position, generation FROM outbox_checkpoints"


# The setting in force in each transaction that moves a checkpoint (the owner's test
# scaffolding: SECURITY DEFINER, so the relay role's updates may write its table).
# The trigger pins its search_path, as the relay's sessions pin theirs (issue #47).
COMMIT_MODES = """
CREATE TABLE advance_commit_modes (setting text NOT NULL);
CREATE FUNCTION record_commit_mode() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = public, pg_catalog AS $$
BEGIN
    INSERT INTO advance_commit_modes VALUES (current_setting('synchronous_commit'));
    RETURN NULL;
END $$;
CREATE TRIGGER record_commit_mode AFTER UPDATE ON outbox_checkpoints FOR EACH ROW
    WHEN ((OLD.transaction_id, OLD.position) IS DISTINCT FROM (NEW.transaction_id, NEW.position))
    EXECUTE FUNCTION record_commit_mode();
"""


def test_a_new_owner_fences_the_old_producer(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    store = OutboxStore(relay_db)
    store.add(
        Subscriber(
            "s", topic=topic_prefix + "outbox.event.{aggregate_type}", value_format=ValueFormat.JSON
        )
    )
    write_orders(writer_db, outbox, ["o-1"])
    settings = load_settings(
        database_url=relay_url, bootstrap_servers=kafka_bootstrap, schemas_dir=REPO / "schemas"
    )
    relay = Relay(settings)
    state = store.get_part("s", 0)
    publishers = unstarted_publishers(relay, relay_db)
    old, new = publishers(state), publishers(state)
    try:
        old.recover(str(state.generation))
        new.recover(str(state.generation))  # same transactional ids: the broker fences `old`
        [event] = store.fetch(state.checkpoint, Selection(10)).events
        record = relay.encoder.encode(event, state.subscriber)
        for _ in range(2):  # each of the part's two producers, taking turns
            with pytest.raises(ProducerFenced):
                old.publish(Batch([record], event.key, str(state.generation)))
        new.publish(Batch([record], event.key, str(state.generation)))
    finally:
        old.close()
        new.close()
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 1)
    assert len(seen) == 1


def test_checkpoint_writes_are_compare_and_set_and_owner_checked(
    relay_db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    store = OutboxStore(relay_db)
    store.add(Subscriber("s"))
    write_orders(writer_db, outbox, ["a", "b"])
    first, second = store.fetch(Position(0, 0), Selection(10)).events
    me, other = store.open_session("me", 1, 30), store.open_session("other", 2, 30)
    assert store.claim("s", 0, me)
    assert not store.claim("s", 0, other), "a claimed part cannot be claimed again"
    state = store.get_part("s", 0)
    store.advance(state, second.key, me)
    with pytest.raises(CheckpointConflict):  # stale version
        store.advance(state, second.key, me)
    fresh = store.get_part("s", 0)
    with pytest.raises(CheckpointConflict):  # never backwards
        store.advance(fresh, first.key, me)
    with pytest.raises(CheckpointConflict):  # never for a relay that does not own it
        store.advance(fresh, second.key, other)
    assert store.get_part("s", 0).checkpoint == second.key


def test_relays_share_parts_and_survive_the_loss_of_one(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    subscribers = [sub("s", topic_prefix, parts=4)]
    first = start_relay(subscribers=subscribers)
    second = start_relay(subscribers=subscribers)
    wait_until(lambda: len(first.workers) == 2 and len(second.workers) == 2, what="a 2/2 split")
    assert set(first.workers).isdisjoint(second.workers)

    keys = [f"k{i}" for i in range(20)]
    write_orders(writer_db, outbox, keys)
    wait_until(lambda: caught_up(db, "s"), what="both relays to publish")
    second.stop()  # releases its claims: the survivor takes them over
    wait_until(lambda: len(first.workers) == 4, what="the survivor to take every part")
    write_orders(writer_db, outbox, keys)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 40)
    assert len(seen) == 40
    assert Counter(ids_of(seen)).most_common(1)[0][1] == 1
    for key, records in by_key(seen).items():
        assert len(records) == 2, key
        assert [r.position for r in records] == sorted(r.position for r in records)


def test_a_record_the_broker_itself_rejects_is_named_and_dead_lettered(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Apache Kafka refuses a record over the topic's max.message.bytes (the producer's
    own limit is higher): the transaction fails, the batch is re-run with delivery
    reports, and only the record at fault goes aside."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic, dlq = topic_prefix + "outbox.event.order", topic_prefix + "dead"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    small = NewTopic(topic, 3, 1, config={"max.message.bytes": "4000"})
    admin.create_topics([small])[topic].result(30)
    with writer_db.transaction():
        write_orders(writer_db, outbox, ["o-1"])
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', 'big', 'Note', jsonb_build_object('blob', repeat('x', 20000)))"
        )
        write_orders(writer_db, outbox, ["o-2"])
    # Its filter names the topic made above: the operator's, so rows may reach it.
    sub_json = sub("s", topic_prefix, value_format="json", on_poison="dead-letter",
                   aggregate_types=["order"])  # fmt: skip
    start_relay(subscribers=[{**sub_json, "dead_letter_topic": dlq}])
    good = consume(kafka_bootstrap, [topic], 2)
    assert sorted(r.key for r in good) == [b"o-1", b"o-2"]
    [dead] = consume(kafka_bootstrap, [dlq], 1)
    assert dead.key == b"big"
    assert "too large" in str(dead.header_text("outbox.error")).lower()


def test_dead_letter_policy_publishes_poison_events_aside_and_goes_on(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    dlq = topic_prefix + "dead"
    with writer_db.transaction():
        write_orders(writer_db, outbox, ["o-1"])
        writer_db.execute(  # no Avro schema for this type: it cannot be encoded
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', 'x', 'Unknown', '{}')"
        )
        # 1.5 MB: larger than the producer's message.max.bytes (but not twice as large,
        # which the fetch would not even read: tests/acceptance/test_memory_bound.py)
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', 'big', 'OrderPlaced', jsonb_build_object('blob', repeat('x', 1500000)))"
        )
        write_orders(writer_db, outbox, ["o-2"])
    relay = start_relay(
        subscribers=[
            sub("s", topic_prefix, on_poison="dead-letter", dead_letter_topic=dlq),
            sub(
                "j",
                topic_prefix + "json.",
                value_format="json",
                on_poison="dead-letter",
                dead_letter_topic=dlq + ".json",
            ),
        ]
    )
    good = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 2)
    assert sorted(r.key for r in good) == [b"o-1", b"o-2"]
    dead = consume(kafka_bootstrap, [dlq], 2)
    assert sorted(r.key for r in dead) == [b"big", b"x"]
    documents = {(r.key or b"").decode(): json.loads(r.value or b"") for r in dead}
    assert "Unknown" in documents["x"]["error"]
    assert documents["big"]["payload_omitted_bytes"] > 1_500_000
    # The JSON subscriber can encode "Unknown"; only the oversized record is poison to it.
    [too_big] = consume(kafka_bootstrap, [dlq + ".json"], 1)
    assert too_big.key == b"big"
    assert "too large" in str(too_big.header_text("outbox.error")).lower()
    wait_until(lambda: worker(relay, "s").stats.dead_lettered == 2, what="the decisions")
    recorded = db.execute(
        "SELECT subscriber, count(*) FROM outbox_dead_letters GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert recorded == [("j", 1), ("s", 2)]


def test_halt_policy_is_recorded_survives_restarts_and_resume_retries(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    with writer_db.transaction():
        write_orders(writer_db, outbox, ["o-1"])
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', 'x', 'Unknown', '{}')"
        )
        write_orders(writer_db, outbox, ["o-2"])
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    wait_until(lambda: worker(relay, "s").stats.state is WorkerState.HALTED, what="the halt")
    store = OutboxStore(db)
    halted = store.get_part("s", 0)
    assert halted.halted_error is not None and "Unknown" in halted.halted_error
    relay.stop()

    again = start_relay(subscribers=[sub("s", topic_prefix)])
    wait_until(lambda: worker(again, "s").stats.state is WorkerState.HALTED, what="halted again")
    after = store.get_part("s", 0)
    assert after.halted_error == halted.halted_error
    assert after.checkpoint == Position(0, 0)

    # The fix (here: the app deletes the bad row), then resume.
    db.execute("DELETE FROM outbox WHERE event_type = 'Unknown'")
    store.set_paused("s", False)
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 2)
    assert sorted(r.key for r in seen) == [b"o-1", b"o-2"]


def test_sigterm_finishes_releases_claims_and_exits_zero(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    OutboxStore(db).add(
        Subscriber(
            "s", topic=topic_prefix + "outbox.event.{aggregate_type}", value_format=ValueFormat.JSON
        )
    )
    env = {
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_HEARTBEAT_INTERVAL": "0.3",
        "RELAY_SESSION_TIMEOUT": "3",
        "RELAY_METRICS_PORT": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "run"],
        env={**os.environ, **env},
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        write_orders(writer_db, outbox, [f"o-{i}" for i in range(50)])
        wait_until(lambda: caught_up(db, "s"), what="the relay to publish")
        proc.send_signal(signal.SIGTERM)
        # A deadline, not a measurement: above shutdown_timeout (30 s), which the relay
        # may use in full on a loaded host and still exit cleanly.
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert db.execute("SELECT count(*) FROM outbox_relay_sessions").fetchone() == (0,)
    assert OutboxStore(db).get_part("s", 0).owner is None


def test_verify_is_clean_after_a_run_and_finds_duplicates_and_gaps(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    write_orders(writer_db, outbox, [f"old-{i}" for i in range(5)])  # before the subscriber existed
    relay = start_relay(subscribers=[sub("s", topic_prefix, value_format="json", start_from="now")])
    write_orders(writer_db, outbox, [f"o-{i}" for i in range(30)])
    wait_until(lambda: caught_up(db, "s"), what="the relay to publish")
    relay.stop()
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    clean = run_cli("verify", "--json", env=env)
    assert clean.returncode == 0, clean.stderr
    [report] = json.loads(clean.stdout)
    assert (report["expected"], report["found"], report["missing"]) == (30, 30, 0)

    # A duplicate (as an at-least-once relay would leave) and a gap (a skipped event).
    [victim] = consume(kafka_bootstrap, [topic], 30)[:1]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, b"{}", victim.key, headers=victim.headers)
    producer.flush(10)
    write_orders(writer_db, outbox, ["o-lost"])
    lost = OutboxStore(db).fetch(Position(0, 0), Selection(100)).events[-1]
    db.execute(  # as a buggy relay would: the checkpoint claims o-lost was published
        "UPDATE outbox_checkpoints SET transaction_id = %s::text::xid8, position = %s",
        (lost.transaction_id, lost.position),
    )
    dirty = run_cli("verify", "--json", env=env)
    assert dirty.returncode == 1
    [report] = json.loads(dirty.stdout)
    assert (report["duplicated"], report["missing"]) == (1, 1)
    assert victim.message_id in report["examples"]["duplicated"][0]


def test_store_lists_parts_with_owner_and_generation(db: psycopg.Connection[Any]) -> None:
    store = OutboxStore(db)
    store.add(
        Subscriber("s", parts=3, value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER)
    )
    [state] = store.list()
    assert [p.part for p in state.parts] == [0, 1, 2]
    generations = {p.generation for p in state.parts}
    store.reset("s", Position(0, 0))
    assert generations.isdisjoint(p.generation for p in store.get("s").parts)
    assert state.subscriber.on_poison is PoisonPolicy.DEAD_LETTER
    assert PartId("s", 2) in {PartId(p.name, p.part) for p in state.parts}
