"""The dead-letter redrive's Postgres side (relay/adapters/postgres/sql/dead_letters.sql) on a real server:
which dead letters are candidates, how a crashed redrive's marks are settled, and one
redrive per subscriber at a time."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.dead_letters import DeadLetterStore
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import Position
from relay.core.subscribers import StartFrom, Subscriber
from relay.errors import SubscriberError
from tests.support import STRANGER_ROLE, wait_until


@pytest.fixture
def store(db: psycopg.Connection[Any]) -> DeadLetterStore:
    """Subscriber s with three dead letters; its checkpoint is past the first two only."""
    subscriber = Subscriber.from_dict({"name": "s", "on_poison": "dead-letter"})
    OutboxStore(db).add(subscriber, StartFrom.BEGINNING)
    for n in range(3):
        with db.transaction():
            db.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "VALUES ('order', %s, 'Bad', '{}')",
                (f"k{n}",),
            )
    db.execute(
        "INSERT INTO outbox_dead_letters (subscriber, part, transaction_id, position, message_id, "
        "topic, error) SELECT 's', 0, transaction_id, position, message_id, 'dlq', 'no schema' "
        "FROM outbox"
    )
    db.execute(
        "UPDATE outbox_checkpoints c SET transaction_id = o.transaction_id, position = o.position "
        "FROM (SELECT * FROM outbox ORDER BY transaction_id, position OFFSET 1 LIMIT 1) o "
        "WHERE c.subscriber = 's'"
    )
    return DeadLetterStore(db)


def test_candidates_stop_at_the_live_checkpoint_in_order(store: DeadLetterStore) -> None:
    letters = store.dead_letters("s")
    assert [d.aggregate_id for d in letters] == ["k0", "k1", "k2"]
    found = store.candidates("s", Position(0, 0), 10)
    # k2 is past the checkpoint: the relay has not committed its dead letter yet.
    assert [c.event.aggregate_id for c in found if c.event] == ["k0", "k1"]
    assert [c.message_id for c in found] == [d.message_id for d in letters[:2]]
    assert store.candidates("s", found[0].key, 10) == found[1:]
    assert store.candidates("s", Position(0, 0), 1) == found[:1]


def test_settle_keeps_the_committed_batch_and_clears_others(
    store: DeadLetterStore, db: psycopg.Connection[Any]
) -> None:
    first, second, third = store.dead_letters("s")
    store.begin("s", 3, [first.message_id])
    store.begin("s", 4, [second.message_id])  # never committed in Kafka
    assert store.settle("s", 3) == (1, 3)
    assert [d.message_id for d in store.dead_letters("s")] == [second.message_id, third.message_id]
    everything = store.dead_letters("s", include_redriven=True)
    assert everything[0].redriven_at is not None
    assert db.execute(
        "SELECT count(*) FROM outbox_dead_letters WHERE redrive_batch IS NOT NULL "
        "AND redriven_at IS NULL"
    ).fetchone() == (0,)
    # Settled again with the same committed number: nothing more happens.
    assert store.settle("s", 3) == (0, 3)
    assert store.candidates("s", Position(0, 0), 10)[0].message_id == second.message_id
    store.refused("s", second.message_id, "still no schema")
    assert store.dead_letters("s")[0].redrive_error == "still no schema"


def test_one_redrive_per_subscriber_at_a_time(store: DeadLetterStore, database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as other:
        elsewhere = DeadLetterStore(other)
        with (
            elsewhere.exclusive("s"),
            pytest.raises(SubscriberError, match="another redrive"),
            store.exclusive("s"),
        ):
            pass
        with store.exclusive("s"):  # released
            pass
    with pytest.raises(SubscriberError, match="no subscriber"):
        store.dead_letters("nobody")


def test_a_redrive_lock_held_by_another_role_names_its_holder(
    store: DeadLetterStore, stranger_url: str, db: psycopg.Connection[Any]
) -> None:
    """Any role may take any advisory lock key: the refusal says whose session to end."""
    with psycopg.connect(stranger_url, autocommit=True, application_name="squatter") as other:
        pid = other.execute("SELECT pg_backend_pid()").fetchone()
        other.execute("SELECT pg_advisory_lock(hashtextextended('outbox-relay.redrive.s', 0))")
        held = f"pid {pid[0] if pid else '?'} (role {STRANGER_ROLE}, application 'squatter')"
        with pytest.raises(SubscriberError, match=re.escape(held)), store.exclusive("s"):
            pass
    # A closed connection's backend ends after the client returns: its lock lives until then.
    wait_until(lambda: not backend_alive(db, pid[0] if pid else 0), what="the squatter's end")
    with store.exclusive("s"):  # the squatter is gone
        pass


def backend_alive(db: psycopg.Connection[Any], pid: int) -> bool:
    row = db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return bool(row and row[0])
