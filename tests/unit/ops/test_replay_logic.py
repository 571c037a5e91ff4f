"""`subscribers replay`'s logic on the in-memory outbox and broker: what a range takes,
its identity on the ledger, and exactly once across runs that die at any batch. (Real
Postgres and Kafka, the CLI killed mid-way: tests/acceptance/test_replay.py.)"""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import uuid4

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import OutboxEvent, Position, Unreadable
from relay.core.ports import Batch
from relay.core.replay import HEADER_REPLAY, ReplayRange
from relay.core.subscribers import Subscriber
from relay.engine.encoding import RecordEncoder
from relay.errors import SubscriberError
from relay.ops.replay import GENERATION, Replay

SUBSCRIBER = Subscriber.from_dict(
    {"name": "s", "topic": "t.{aggregate_type}", "value_format": "json",
     "aggregate_types": ["order", "customer"]}
)  # fmt: skip


def outbox(count: int) -> tuple[InMemoryStore, list[OutboxEvent]]:
    """``count`` events, three per transaction, of order, customer and invoice by turns."""
    store = InMemoryStore()
    types = ("order", "customer", "invoice")
    events = [
        store.append(
            OutboxEvent(
                100 + n // 3,
                n % 3 + 1,
                uuid4(),
                types[n % 3],
                f"k{n % 4}",
                None,
                "Happened",
                {"n": n},
                {},
                datetime.now(UTC),
            )
        )
        for n in range(count)
    ]
    return store, events


class Dies(Exception):
    """Stands for the process killed."""


class DiesAfter:
    """The broker, with the process killed after ``commits`` more transactions (the
    last one committed: the kill fell after the commit)."""

    def __init__(self, broker: InMemoryPublisher, commits: int) -> None:
        self.broker, self.commits = broker, commits

    def recover(self, generation: str, key_space: object = None) -> object:
        return self.broker.recover(generation)

    def publish(self, batch: Batch) -> None:
        if self.commits == 0:
            raise Dies("killed before this transaction committed")
        self.commits -= 1
        self.broker.publish(batch)

    def close(self) -> None:
        pass


def run(store: InMemoryStore, publisher: object, wanted: ReplayRange, batch: int = 2) -> int:
    encode = RecordEncoder(None).for_subscriber(wanted.publisher_of(SUBSCRIBER))
    return Replay(store, publisher, encode, wanted, 7, batch_size=batch).run()  # type: ignore[arg-type]


def ids(broker: InMemoryPublisher) -> list[str | None]:
    return [r.outbox_message_id for r in broker.published()]


def test_a_range_takes_its_events_the_filters_match_both_ends_included() -> None:
    store, events = outbox(12)
    wanted = ReplayRange.of(
        SUBSCRIBER, events[1].key, events[10].key, "again", ["order", "invoice"]
    )
    broker = InMemoryPublisher()
    assert run(store, broker, wanted) == 3
    # order only: the subscriber takes order and customer, the replay order and invoice.
    expected = [str(e.message_id) for e in events[1:11] if e.aggregate_type == "order"]
    assert ids(broker) == expected
    for record in broker.published():
        assert record.topic == "again"
        assert record.header(HEADER_REPLAY) == b"7"
    assert broker.checkpoints[GENERATION].position == events[9].key


@pytest.mark.parametrize("commits", [0, 1, 2, 3])
def test_a_run_killed_after_any_batch_then_run_again_publishes_each_event_once(
    commits: int,
) -> None:
    store, events = outbox(20)
    wanted = ReplayRange.of(SUBSCRIBER, events[0].key, events[-1].key, "again")
    broker = InMemoryPublisher()
    with pytest.raises(Dies):
        run(store, DiesAfter(broker, commits), wanted)
    assert len(broker.transactions) == commits
    again = Replay(
        store, broker, RecordEncoder(None).for_subscriber(wanted.publisher_of(SUBSCRIBER)),
        wanted, 7, batch_size=2,
    )  # fmt: skip
    again.run()
    expected = [str(e.message_id) for e in events if e.aggregate_type != "invoice"]
    assert ids(broker) == expected
    assert (again.resumed_after is None) == (commits == 0)
    # A third run finds the cursor at the end: nothing more.
    assert run(store, broker, wanted) == 0
    assert ids(broker) == expected


def test_the_own_topics_keep_the_subscribers_routing() -> None:
    store, events = outbox(3)
    broker = InMemoryPublisher()
    run(store, broker, ReplayRange.of(SUBSCRIBER, events[0].key, events[2].key, None))
    assert [r.topic for r in broker.published()] == ["t.order", "t.customer"]


def test_filters_narrow_the_subscribers_never_widen_them() -> None:
    wanted = ReplayRange.of(SUBSCRIBER, Position(1, 1), Position(2, 1), None, ["invoice"])
    assert wanted.aggregate_types == frozenset()
    store, _ = outbox(9)
    broker = InMemoryPublisher()
    assert run(store, broker, wanted) == 0


def test_the_args_are_the_replays_identity_on_the_ledger() -> None:
    wanted = ReplayRange.of(SUBSCRIBER, Position(5, 1), Position(9, 2), "x", None, ["A", "B"])
    assert ReplayRange.from_args(wanted.args()) == wanted
    assert wanted.args() == {
        "from": "5:1", "to": "9:2", "into": "x",
        "aggregate_types": ["customer", "order"], "event_types": ["A", "B"],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("start", "end", "into", "error"),
    [
        (Position(9, 1), Position(5, 1), None, "is after --to"),
        (Position(1, 1), Position(5, 1), "no spaces", "not a legal Kafka topic name"),
    ],
)
def test_a_range_that_cannot_be_is_refused(
    start: Position, end: Position, into: str | None, error: str
) -> None:
    with pytest.raises(SubscriberError, match=error):
        ReplayRange.of(SUBSCRIBER, start, end, into)


def test_an_event_that_cannot_be_encoded_stops_the_run_and_names_it() -> None:
    plain = Subscriber.from_dict({"name": "s", "topic": "t", "value_format": "json"})
    store, events = outbox(4)
    poison = store.append(
        events[0]._replace(
            transaction_id=200, message_id=uuid4(), payload=Unreadable("an integer too long")
        )
    )
    wanted = ReplayRange.of(plain, events[0].key, poison.key, "again")
    broker = InMemoryPublisher()
    replay = Replay(
        store, broker, RecordEncoder(None).for_subscriber(plain), wanted, 7, batch_size=10
    )
    with pytest.raises(SubscriberError, match=f"event {poison.message_id} .* cannot be replayed"):
        replay.run()


def test_a_replay_publishes_the_bytes_the_relay_published() -> None:
    """A json subscriber that passes its payloads through (issue #53) is replayed the same
    way: Postgres's text, not the compact form."""
    store, events = outbox(3)
    wanted = ReplayRange.of(SUBSCRIBER, events[0].key, events[2].key, None)
    publishing = wanted.publisher_of(SUBSCRIBER)
    assert publishing.publishing.raw_payloads
    broker = InMemoryPublisher()
    encode = RecordEncoder(None).for_subscriber(publishing)
    Replay(store, broker, encode, wanted, 7, batch_size=2, raw_payloads=True).run()
    assert [r.value for r in broker.published()] == [b'{"n": 0}', b'{"n": 1}']
