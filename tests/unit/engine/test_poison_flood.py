"""A flood of poison rows (issue #47, medium 6) over the in-memory store and publisher:
dead letters go out a batch at a time, each batch read once, and the log samples the
flood's warnings. Each test runs a real worker thread until the outbox is published."""

from __future__ import annotations

import logging
import random
import uuid
from datetime import UTC, datetime

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.log_sampling import FIRST
from relay.core.model import OutboxEvent, PartId, Position
from relay.core.ports import Fetched, RelaySession, Selection
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import MAX_STORED_ERROR_BYTES
from relay.engine.worker import PartWorker
from tests.support import wait_until

OWNER = uuid.uuid4()
# Routed by aggregate type: a type with a space routes to an illegal topic name.
ROUTED = Subscriber(
    "s", topic="t.{aggregate_type}", value_format=ValueFormat.JSON,
    on_poison=PoisonPolicy.DEAD_LETTER,
)  # fmt: skip


class SpreadStore(InMemoryStore):
    """Keys far apart at random, as one part's rows among a busy outbox's (the least
    compressible a tag's keys get); counts the fetches that read rows."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self._rng = random.Random(11)

    def append(self, event: OutboxEvent) -> OutboxEvent:
        committed = super().append(event)
        last = self.events[-2].key if len(self.events) > 1 else Position(100, 0)
        key = Position(last.transaction_id + self._rng.randrange(1, 2**20), 1)
        self.events[-1] = committed._replace(transaction_id=key.transaction_id)
        return self.events[-1]

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        fetched = super().fetch(after, selection)
        self.reads += bool(fetched.events)
        return fetched


def row(n: int, aggregate_type: str) -> OutboxEvent:
    return OutboxEvent(
        transaction_id=0, position=0, message_id=uuid.uuid4(), aggregate_type=aggregate_type,
        aggregate_id=f"k{n}", aggregate_version=None, event_type="Note", payload={"n": n},
        headers={}, occurred_at=datetime.now(UTC), stored_bytes=0,
    )  # fmt: skip


def flood(
    store: InMemoryStore, poison: int, long: int = 241
) -> tuple[list[OutboxEvent], OutboxEvent]:
    """``poison`` rows routed to an illegal topic (its name, in the error, quotes
    ``long`` + 9 bytes of the row), then one good row."""
    bad = [store.append(row(n, "bad type " + "x" * long)) for n in range(poison)]
    return bad, store.append(row(poison, "good"))


def publish(
    store: InMemoryStore, kafka: InMemoryPublisher, batch_max_bytes: int = 2**62
) -> PartWorker:
    store.add(ROUTED)
    store.open_session("test", 1, 3600, session_id=OWNER)
    assert store.claim("s", 0, OWNER)
    w = PartWorker(
        PartId("s", 0), session=RelaySession(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store, open_publisher=lambda state: kafka,
        encoder=RecordEncoder(None), batch_size=5000, batch_max_bytes=batch_max_bytes,
        poll_interval=0.05,
    )  # fmt: skip
    last = store.events[-1].key
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, timeout=120, what="publish")
    finally:
        w.stop()
        w.join(10)
    return w


def test_a_flood_goes_out_a_tag_at_a_time_each_batch_read_once() -> None:
    """3,000 poison rows with keys the tag cannot compress: cut where the Kafka-side
    checkpoint can name no more, the rest of the batch goes next without being read
    again. (At 32 a transaction, each cut read the batch again: 94 reads.)"""
    store, kafka = SpreadStore(), InMemoryPublisher()
    bad, good = flood(store, 3000)
    w = publish(store, kafka)
    assert store.reads == 1  # one batch of 5,000 rows holds them all
    assert 1 < len(kafka.transactions) < 10  # cut by the tag's size, never at 32
    assert min(map(len, kafka.transactions[:-1])) > 300
    dead = [r for r in kafka.published() if r.topic == ROUTED.dead_letter_topic_name]
    assert sorted(r.outbox_message_id or "" for r in dead) == sorted(str(e.message_id) for e in bad)
    assert [r.outbox_message_id for r in kafka.published() if r.topic == "t.good"] == [
        str(good.message_id)
    ]
    assert set(store.dead["s"]) == {e.message_id for e in bad}
    assert w.stats.dead_lettered == 3000


def test_a_floods_dead_letters_are_cut_at_batch_max_bytes_each_batch_read_once() -> None:
    """A dead letter outweighs its row (it quotes the error twice): 200 rows of a few
    bytes make 200 KB of dead letters, which go in transactions of batch_max_bytes."""
    store, kafka = SpreadStore(), InMemoryPublisher()
    bad, _ = flood(store, 200)
    publish(store, kafka, batch_max_bytes=20_000)
    assert store.reads == 1
    dead = ROUTED.dead_letter_topic_name
    sizes = [sum(r.byte_size() for r in t if r.topic == dead) for t in kafka.transactions]
    assert len(sizes) > 5 and max(sizes) <= 20_000
    assert sorted(store.dead["s"]) == sorted(e.message_id for e in bad)


def test_stored_errors_are_capped_and_the_record_keeps_the_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, kafka = InMemoryStore(), InMemoryPublisher()
    flood(store, 3, long=2000)
    publish(store, kafka)
    decisions = [decision for _, decision in store.dead["s"].values()]
    assert all(len(d.error.encode()) <= MAX_STORED_ERROR_BYTES for d in decisions)
    assert all("...[cut: " in d.error for d in decisions)
    dead = [r for r in kafka.published() if r.topic == ROUTED.dead_letter_topic_name]
    assert all(len(r.header("outbox.error") or b"") > MAX_STORED_ERROR_BYTES for r in dead)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned and all(len(m.encode()) < MAX_STORED_ERROR_BYTES + 300 for m in warned)


def test_a_floods_warnings_are_sampled_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """1,000 poison rows: the first few warnings one by one, then one line that says how
    many were left out; a counter has them all."""
    caplog.set_level(logging.INFO)
    store, kafka = InMemoryStore(), InMemoryPublisher()
    flood(store, 1000)
    w = publish(store, kafka)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= FIRST + 1
    [summary] = [r for r in warnings if "were not logged one by one" in r.getMessage()]
    assert summary.getMessage().startswith(f"part s/0: {1000 - FIRST} more poison events")
    assert w.stats.poison_warnings_sampled_out == 1000 - FIRST
    assert w.stats.poisoned == 1000
