"""Issue #47, mediums 4 and 5: the topics a row's template field lets writers choose are
confined. One writer's junk types cannot use up the topics the operator declared, a
full budget makes the part wait (never a legal row's poison), and a row cannot publish
into another outbox's topic. Real Postgres and Apache Kafka; the relay as the relay
role, rows from the writer role (one of them hostile)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import PartId
from relay.core.settings import load_settings
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from tests.acceptance.test_hostile_rows import insert
from tests.support import (
    consume,
    grant_test_roles,
    keyed,
    keys,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
    worker,
)

StartRelay = Callable[..., Relay]


def test_junk_types_cannot_use_up_the_topics_the_operator_declared(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """One INSERT of 100 junk aggregate types used up max_created_topics (100): the next
    legitimate type, Invoice, was then poison, for good. The operator declared billing's
    Invoice topic (a filter names it): it is created whatever rows made. The free
    template's part waits for room instead, alerted, and goes on once there is."""
    settings: dict[str, Any] = {
        "topic_partitions": 1,
        "subscribers": [
            sub("events", topic_prefix, value_format="json", on_poison="dead-letter",
                dead_letter_topic=topic_prefix + "dead"),
            {"name": "billing", "topic": topic_prefix + "billing.{aggregate_type}",
             "aggregate_types": ["Invoice"], "value_format": "json"},
        ],
    }  # fmt: skip
    writer_db.execute(  # the hostile writer: one INSERT, 100 aggregate types
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'junk' || g, 'j', 'Junk', '{}' FROM generate_series(0, 99) g"
    )
    relay = start_relay(**settings)
    wait_caught_up(db, "events")  # 100 topics made for rows: the budget is used up
    insert(writer_db, "inv-1", '{"amount_cents": 1250}', aggregate_type="Invoice")

    [invoice] = consume(kafka_bootstrap, [topic_prefix + "billing.Invoice"], 1)
    assert invoice.key == b"inv-1"
    events = PartId("events", 0)
    wait_until(lambda: relay.part_waits().get(events) == "topic_budget", what="events waits")
    stats = worker(relay, "events").stats
    assert stats.state is WorkerState.RETRYING and stats.poisoned == 0
    assert stats.last_error is not None and "max_created_topics (100)" in stats.last_error
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)
    shown = run_cli("status", env={"RELAY_DATABASE_URL": relay_url})
    assert shown.returncode == 0, shown.stderr
    assert "100 of max_created_topics (100)" in shown.stdout, shown.stdout

    relay.stop()  # the operator raises the budget: the part goes on, nothing lost
    start_relay(**{**settings, "max_created_topics": 101})
    [later] = consume(kafka_bootstrap, [topic_prefix + "outbox.event.Invoice"], 1)
    assert later.key == b"inv-1"
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)


def test_a_row_cannot_publish_into_another_outboxs_topic(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """With the defaults, a writer published into an existing outbox.event.Payment that
    no subscriber of this relay owned (another outbox's), and its consumers could not
    tell the record from a genuine one. A topic a row chose must be one this outbox
    created (remembered across restarts), one a filter names, or one topic_allow
    matches."""
    theirs = topic_prefix + "outbox.event.Payment"
    _another_outboxs_topic(kafka_bootstrap, theirs)
    settings = {
        "subscribers": [
            sub("s", topic_prefix, value_format="json", on_poison="dead-letter",
                dead_letter_topic=topic_prefix + "dead"),
        ],
    }  # fmt: skip
    ours = [topic_prefix + "outbox.event.order", topic_prefix + "outbox.event.customer"]
    insert(writer_db, "o-1", "{}", aggregate_type="order")
    insert(writer_db, "p-1", '{"to": "attacker-account"}', aggregate_type="Payment")
    insert(writer_db, "o-2", "{}", aggregate_type="order")
    insert(writer_db, "c-1", "{}", aggregate_type="customer")
    relay = start_relay(**settings)

    [refused] = consume(kafka_bootstrap, [topic_prefix + "dead"], 1)
    assert refused.key == b"p-1"
    reason = refused.header_text("outbox.error")
    assert "this outbox did not create it" in reason and "topic_allow" in reason, reason
    assert keys(consume(kafka_bootstrap, ours, 3)) == ["c-1", "o-1", "o-2"]

    relay.stop()  # a restart remembers the topics this outbox created
    start_relay(**settings)
    insert(writer_db, "o-3", "{}", aggregate_type="order")
    insert(writer_db, "p-2", "{}", aggregate_type="Payment")
    wait_caught_up(db, "s")
    published = consume(kafka_bootstrap, ours, 4)
    assert Counter(keys(published)) == Counter(["c-1", "o-1", "o-2", "o-3"])  # each once
    assert keys(consume(kafka_bootstrap, [topic_prefix + "dead"], 2)) == ["p-1", "p-2"]
    assert keys(consume(kafka_bootstrap, [theirs], 1)) == ["genuine"]


def test_an_upgraded_outbox_keeps_publishing_to_the_topics_its_relays_created(
    database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Its relays created topics before the outbox recorded them (migration 0017): the
    first relay to start after the upgrade adopts those its templates reach, so rows go
    on publishing there; a topic that appears later is not the rows' to reach."""
    old, later = topic_prefix + "outbox.event.order", topic_prefix + "outbox.event.Payment"
    with psycopg.connect(database_url, autocommit=True) as owner:  # the owner upgrades
        migrations.migrate(owner, up_to=16)
        subscriber = Subscriber(
            "s",
            topic=topic_prefix + "outbox.event.{aggregate_type}",
            value_format=ValueFormat.JSON,
            on_poison=PoisonPolicy.DEAD_LETTER,
            dead_letter_topic=topic_prefix + "dead",
        )
        OutboxStore(owner).add(subscriber)
        _another_outboxs_topic(kafka_bootstrap, old)  # as the old relay created it
        migrations.migrate(owner)
    roles = grant_test_roles(database_url)
    relay = Relay(
        load_settings(
            database_url=roles.relay_url,
            bootstrap_servers=kafka_bootstrap,
            poll_interval=0.2,
            metrics_port=0,
        )
    )
    relay.start()
    try:
        _another_outboxs_topic(kafka_bootstrap, later)  # after the adoption
        with psycopg.connect(roles.writer_url, autocommit=True) as writer:
            insert(writer, "o-1", "{}", aggregate_type="order")
            insert(writer, "p-1", "{}", aggregate_type="Payment")
        assert keyed(consume(kafka_bootstrap, [old], 2)).keys() == {"genuine", "o-1"}
        [refused] = consume(kafka_bootstrap, [topic_prefix + "dead"], 1)
        assert refused.key == b"p-1"
    finally:
        relay.stop()
    with psycopg.connect(database_url, autocommit=True) as owner:
        adopted = owner.execute("SELECT topic, origin FROM outbox_topics").fetchall()
    assert adopted == [(old, "adopted")]


def _another_outboxs_topic(bootstrap: str, topic: str) -> None:
    """``topic``, made and written to by someone else (another outbox's relay)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, key=b"genuine", value=b"{}")
    assert producer.flush(30) == 0
