"""Issue #47, medium 6: a hostile writer's flood of poison rows, against a real Postgres
and Apache Kafka, the relay as the role `outbox-relay grant` makes. One INSERT of 20,000
rows that route to illegal topic names under a dead-letter subscriber, then one good
event: every poison row is dead-lettered exactly once, the good event arrives, and what
the flood leaves in the table and the log is bounded.

It used to take 32 dead letters a transaction (the Kafka-side checkpoint named each by
message id) and read the batch again for each 32: about 40 rows a second, the good
event 7 minutes behind. The rate is printed (`-s`), never asserted on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.log_sampling import FIRST
from relay.core.ports import Batch, DeadLetterDecision, Selection
from relay.core.settings import load_settings
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.daemon import Relay
from relay.engine.poison import MAX_STORED_ERROR_BYTES, dead_letter_record
from tests.support import consume, sub, unstarted_publishers, wait_until, worker, write_orders

StartRelay = Callable[..., Relay]
FLOOD = 20_000


@pytest.mark.timeout(900)  # 20,000 rows through the relay and back, on 2 busy cores
def test_a_flood_of_poison_rows_is_dead_lettered_once_each_and_bounded(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    caplog: pytest.LogCaptureFixture,
    record_property: Callable[[str, object], None],
) -> None:
    # One statement, as any writer may: each row's topic, '<prefix>bad type xx...x.ee...e',
    # is illegal, and long enough (about 520 bytes) that its error is cut.
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'bad type ' || repeat('x', 240), 'k' || g, repeat('e', 250),"
        "        jsonb_build_object('n', g)"
        "   FROM generate_series(1, %s) AS g",
        (FLOOD,),
    )
    write_orders(writer_db, outbox, ["good"])
    dead = topic_prefix + "dead"
    started = time.monotonic()
    relay = start_relay(
        subscribers=[
            sub("dl", "", topic=topic_prefix + "{aggregate_type}.{event_type}",
                value_format="json", on_poison="dead-letter", dead_letter_topic=dead),
        ]
    )  # fmt: skip
    # A ceiling for a loaded machine: at 40 rows a second this was 8 minutes.
    [good] = consume(kafka_bootstrap, [topic_prefix + "order.OrderPlaced"], 1, timeout=300)
    arrived = time.monotonic() - started
    assert good.key == b"good"

    letters = consume(kafka_bootstrap, [dead], FLOOD, timeout=300, quiet=2.0)
    ids = [r.message_id for r in letters]
    assert len(ids) == FLOOD and len(set(ids)) == FLOOD, "each poison row once"
    count, distinct, longest, first, last = db.execute(
        "SELECT count(*), count(DISTINCT message_id), max(octet_length(error)),"
        "       extract(epoch FROM min(decided_at)), extract(epoch FROM max(decided_at))"
        "  FROM outbox_dead_letters WHERE subscriber = 'dl'"
    ).fetchone() or (0, 0, 0, 0, 0)
    assert (count, distinct) == (FLOOD, FLOOD)
    assert {str(m) for (m,) in db.execute("SELECT message_id FROM outbox_dead_letters")} == set(ids)
    # Capped in the table (the record's header keeps up to 8 KiB).
    assert longest <= MAX_STORED_ERROR_BYTES
    assert len(letters[0].header("outbox.error") or b"") > MAX_STORED_ERROR_BYTES

    # Sampled in the log: the first few one by one, then a line that counts the rest.
    wait_until(lambda: worker(relay, "dl").stats.poison_warnings_sampled_out > 0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    poison = [r for r in warnings if "poison event" in r.getMessage()]
    assert FIRST <= len(poison) <= 3 * (FIRST + 1), len(poison)
    assert len(warnings) < 100, [r.getMessage()[:200] for r in warnings[:20]]
    assert all(len(r.getMessage().encode()) <= MAX_STORED_ERROR_BYTES + 300 for r in poison)
    # (A batch retried, its transaction's fate unknown, meets its poison rows again.)
    stats = worker(relay, "dl").stats
    assert stats.poisoned >= FLOOD
    assert stats.poison_warnings_sampled_out >= FLOOD - 3 * FIRST

    rate = FLOOD / max(float(last) - float(first), 1e-3)
    print(
        f"\n{FLOOD} poison rows dead-lettered in {float(last) - float(first):.1f} s"
        f" ({rate:,.0f} rows/s, decided_at); the good event arrived {arrived:.1f} s"
        " after the relay started"
    )
    record_property("dead_letter_rows_per_s", round(rate))
    record_property("good_event_after_s", round(arrived, 1))


def test_a_new_owner_records_every_dead_letter_of_the_transaction_it_adopts(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """The crash between the Kafka commit and the Postgres one (docs/design.md §5, §7),
    with a batch of 5,000 dead letters: the Kafka-side checkpoint names them all (it
    named 32 at most), and the owner that adopts it records every decision, publishing
    none of them again."""
    rows = 5000
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'bad type', 'k' || g, 'Note', '{}' FROM generate_series(1, %s) AS g",
        (rows,),
    )
    dead = topic_prefix + "dead"
    subscriber = Subscriber(
        "dl", topic=topic_prefix + "{aggregate_type}", value_format=ValueFormat.JSON,
        on_poison=PoisonPolicy.DEAD_LETTER, dead_letter_topic=dead,
    )  # fmt: skip
    store = OutboxStore(relay_db)  # the doomed relay's
    store.add(subscriber)
    # A relay that commits the batch of dead letters to Kafka and dies before Postgres.
    doomed = Relay(load_settings(database_url=relay_url, bootstrap_servers=kafka_bootstrap))
    session = store.open_session("doomed", 1, 30)
    assert store.claim("dl", 0, session)
    state = store.get_part("dl", 0)
    publisher = unstarted_publishers(doomed, relay_db)(state)
    assert publisher.recover(str(state.generation), store.key_space().id) is None
    events = store.fetch(state.checkpoint, Selection(rows)).events
    assert len(events) == rows
    decision = DeadLetterDecision(dead, "routed to an illegal topic name")
    records = [dead_letter_record(e, subscriber, decision) for e in events]
    named = [(e.key, dead) for e in events]
    publisher.publish(Batch(records, events[-1].key, str(state.generation), dead_letters=named))
    publisher.close()
    store.close_session(session)
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)

    write_orders(writer_db, outbox, ["good"])
    relay = start_relay()
    [good] = consume(kafka_bootstrap, [topic_prefix + "order"], 1, timeout=120)
    assert good.key == b"good"
    letters = consume(kafka_bootstrap, [dead], rows, timeout=120, quiet=2.0)
    assert len(letters) == rows and len({r.message_id for r in letters}) == rows
    recorded = {str(m) for (m,) in db.execute("SELECT message_id FROM outbox_dead_letters")}
    assert recorded == {str(e.message_id) for e in events}
    assert worker(relay, "dl").stats.recovered == 1
