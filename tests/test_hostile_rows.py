"""Issue #17: an application that may only INSERT into the outbox must not be able to
harm publication for everyone else. Each test writes a hostile row, then an ordinary
one, against a real Postgres and Apache Kafka, and checks the ordinary one is published
while the hostile one goes where the subscriber's poison policy says."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.daemon import Relay
from relay.model import OutboxEvent, Position
from relay.store import OutboxStore
from relay.subscribers import Subscriber, ValueFormat
from relay.worker import WorkerState
from tests.support import consume, sub, wait_caught_up, write_orders
from tests.test_exactly_once import wait_until
from tests.test_worker_logic import FakeKafka, FakeStore
from tests.test_worker_logic import event as logic_event
from tests.test_worker_logic import worker as logic_worker

StartRelay = Callable[..., Relay]


def insert(db: psycopg.Connection[Any], key: str, payload: str, **columns: Any) -> None:
    """A row as any application may write it in plain SQL."""
    names = ["aggregate_type", "aggregate_id", "event_type", "payload", *columns]
    values = ["order", key, "Note", payload, *columns.values()]
    placeholders = ", ".join(["%s"] * len(values))
    db.execute(
        f"INSERT INTO outbox ({', '.join(names)}) VALUES ({placeholders})",  # type: ignore[arg-type]
        values,
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
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """Postgres accepts an integer of 5,001 digits and 1,020 levels of nesting; Python
    refuses to load the first and to write the second. Each is its row's poison."""
    write_orders(db, outbox, ["before"])
    insert(db, "huge", '{"n": 1e5000}')
    insert(db, "deep", "[" * 1020 + "]" * 1020)
    insert(db, "deep-header", "{}", headers='{"h": ' + "[" * 1020 + "]" * 1020 + "}")
    insert(db, "forever", '{"ok": true}', occurred_at="infinity")  # legal: published
    write_orders(db, outbox, ["after"])
    relay = start_relay(subscribers=json_subscribers(topic_prefix))

    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 3)
    assert sorted(r.key for r in seen) == ["after", "before", "forever"]
    dead = {r.key: r for r in consume(kafka_bootstrap, [topic_prefix + "dead"], 3)}
    assert sorted(dead) == ["deep", "deep-header", "huge"]
    assert "digits" in dead["huge"].headers["outbox.error"]
    assert "Recursion" in dead["deep"].headers["outbox.error"]
    assert "Recursion" in dead["deep-header"].headers["outbox.error"]
    assert "payload_omitted" in json.loads(dead["huge"].value)

    wait_until(lambda: relay.worker("halt").stats.state is WorkerState.HALTED, what="halt")
    halted = OutboxStore(db).get_part("halt", 0)
    assert halted.halted_error is not None and "digits" in halted.halted_error
    for name in ("dl", "halt"):
        stats = relay.worker(name).stats
        assert stats.unexpected == 0 and stats.poisoned >= 1
        assert relay.worker(name).is_alive() or stats.state is WorkerState.HALTED


class _FailingStore(FakeStore):
    """A store whose fetch fails the way no one foresaw, once."""

    conn = SimpleNamespace(close=lambda: None)

    def __init__(self, subscriber: Subscriber) -> None:
        super().__init__(subscriber)
        self.failures = 1

    def fetch(self, after: Position, limit: int, **part: Any) -> list[OutboxEvent]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("nobody saw this coming")
        return super().fetch(after, limit, **part)


def test_an_unexpected_exception_is_counted_logged_and_the_worker_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _FailingStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON))
    store.outbox = [logic_event(1)]
    kafka = FakeKafka()
    w = logic_worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: kafka.transactions != [], what="the event, after the failure")
        assert w.is_alive()
        assert w.stats.unexpected == 1 and w.stats.errors == 1
        assert w.stats.last_error == "nobody saw this coming"
    finally:
        w.stop()
        w.join(10)
    [logged] = [r for r in caplog.records if "unexpected RuntimeError" in r.getMessage()]
    assert logged.exc_info is not None  # with its traceback


def test_forged_ordering_keys_are_replaced_so_every_row_is_published(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    """The table's owner may name transaction_id and position (OVERRIDING SYSTEM VALUE).
    A key below the checkpoint used to be skipped; one of 2^62 or 2^64-1 kept its row
    pending for ever. The outbox now assigns both, whatever the writer says."""
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    write_orders(db, outbox, ["first"])
    wait_caught_up(db, "s")  # the checkpoint is past transaction id 5 now
    for key, forged in (("below", 5), ("far", 2**62), ("last", 2**64 - 1)):
        db.execute(
            "INSERT INTO outbox (transaction_id, position, aggregate_type, aggregate_id,"
            " event_type, payload) OVERRIDING SYSTEM VALUE"
            " VALUES (%s::text::xid8, 1, 'order', %s, 'Note', '{}')",
            (str(forged), key),
        )
    write_orders(db, outbox, ["after"])

    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 5)
    assert sorted(r.key for r in seen) == ["after", "below", "far", "first", "last"]
    wait_caught_up(db, "s")  # nothing left pending: no false lag
    positions = db.execute("SELECT position FROM outbox ORDER BY transaction_id, position")
    assert len({p for (p,) in positions}) == 5  # no forged position 1 left
