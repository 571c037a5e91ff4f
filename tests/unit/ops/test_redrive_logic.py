"""Dead-letter redrive's decisions, on fakes: what a batch holds, what stays dead-lettered
and why, and how it numbers its transactions after a crash. (The real Postgres and Kafka
runs, crashes included, are in tests/acceptance/test_redrive.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

import pytest

from relay.core.dead_letters import Candidate
from relay.core.model import KafkaCheckpoint, OutboxEvent, Position
from relay.core.ports import Batch, SubscriberState
from relay.core.subscribers import Subscriber
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import MAX_STORED_ERROR_BYTES
from relay.errors import PoisonRecordError
from relay.ops.redrive import Redrive

SUBSCRIBER = Subscriber.from_dict(
    {"name": "s", "topic": "t.{aggregate_type}", "value_format": "json", "on_poison": "dead-letter"}
)


def event(n: int, key: str, payload: Any = None) -> OutboxEvent:
    return OutboxEvent(
        10 + n, n, uuid4(), "order", key, None, "OrderPlaced",
        {"n": n} if payload is None else payload, {}, datetime.now(UTC),
    )  # fmt: skip


class FakeStore:
    """The dead letters of subscriber s, and every call made."""

    def __init__(self, events: list[OutboxEvent | Position], used_batches: int = 0) -> None:
        # A Position: the dead letter of a row prune deleted since.
        self.letters = [
            Candidate(uuid4(), e, None)
            if isinstance(e, Position)
            else Candidate(e.message_id, e.key, e)
            for e in events
        ]
        self.calls: list[tuple[Any, ...]] = []
        self.used_batches = used_batches
        self.refusals: dict[UUID, str] = {}

    @contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        yield

    def settle(self, name: str, committed: int) -> tuple[int, int]:
        self.calls.append(("settle", committed))
        return 0, max(committed, self.used_batches)

    def candidates(self, name: str, after: Position, limit: int) -> list[Candidate]:
        return [c for c in self.letters if c.key > after][:limit]

    def begin(self, name: str, batch: int, ids: Any) -> None:
        self.calls.append(("begin", batch, list(ids)))

    def abandon(self, name: str, batch: int) -> None:
        self.calls.append(("abandon", batch))

    def done(self, name: str, batch: int) -> None:
        self.calls.append(("done", batch))

    def refused(self, name: str, message_id: UUID, error: str) -> None:
        self.refusals[message_id] = error


class FakePublisher:
    """Commits every batch, except that the broker refuses records of ``refuse`` (all
    of them in one go when ``ambiguous``)."""

    def __init__(
        self,
        refuse: set[UUID] = frozenset(),  # type: ignore[assignment]
        *,
        ambiguous: bool = False,
        committed: int | None = None,
    ) -> None:
        self.refuse = refuse
        self.ambiguous = ambiguous
        self.committed_batch = committed
        self.committed: list[list[str]] = []

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        if self.committed_batch is None:
            return None
        return KafkaCheckpoint(Position(self.committed_batch, 0))

    def publish(self, batch: Batch) -> None:
        ids = [r.outbox_message_id or "" for r in batch.records]
        bad = [r for r in batch.records if UUID(r.outbox_message_id or "") in self.refuse]
        if bad:
            raise PoisonRecordError(
                bad[0], "MSG_SIZE_TOO_LARGE", ambiguous=self.ambiguous and len(batch.records) > 1
            )
        assert batch.end == Position(batch.end.transaction_id, 0)
        self.committed.append(ids)

    def close(self) -> None:
        pass


def redrive(store: FakeStore, publisher: FakePublisher, batch_size: int = 100) -> Any:
    state = SubscriberState(SUBSCRIBER, uuid4(), [])
    return Redrive(store, publisher, RecordEncoder(None), state, batch_size=batch_size).run()


def ids(*events: OutboxEvent) -> list[str]:
    return [str(e.message_id) for e in events]


def test_a_record_the_broker_refuses_stays_with_its_keys_later_events() -> None:
    a1, b1, a2, c1 = event(1, "a"), event(2, "b"), event(3, "a"), event(4, "c")
    store = FakeStore([a1, b1, a2, c1])
    publisher = FakePublisher({a1.message_id})
    report = redrive(store, publisher)
    assert publisher.committed == [ids(b1, c1)]  # one transaction, after the refused one
    assert report.redriven == 2
    assert list(report.still_poison) == [a1.message_id]
    assert report.held_back == [a2.message_id]
    assert "MSG_SIZE_TOO_LARGE" in store.refusals[a1.message_id]
    assert "held back" in store.refusals[a2.message_id]
    # The aborted attempt is unmarked before the retry, under the same number.
    assert store.calls == [
        ("settle", 0),
        ("begin", 1, [a1.message_id, b1.message_id, a2.message_id, c1.message_id]),
        ("abandon", 1),
        ("begin", 1, [b1.message_id, c1.message_id]),
        ("done", 1),
    ]


def test_an_ambiguous_refusal_is_narrowed_down_one_record_per_transaction() -> None:
    a1, b1, a2 = event(1, "a"), event(2, "b"), event(3, "a")
    publisher = FakePublisher({b1.message_id}, ambiguous=True)
    report = redrive(FakeStore([a1, b1, a2]), publisher)
    assert publisher.committed == [ids(a1), ids(a2)]
    assert list(report.still_poison) == [b1.message_id]
    assert report.redriven == 2


def test_events_that_still_cannot_be_encoded_or_were_pruned_stay() -> None:
    bad = event(1, "a", payload={"not json": {1, 2}})  # a set: JSON cannot hold it
    a2, b1 = event(2, "a"), event(3, "b")
    store = FakeStore([bad, Position(11, 5), a2, b1])
    publisher = FakePublisher()
    report = redrive(store, publisher)
    assert publisher.committed == [ids(b1)]
    assert list(report.still_poison) == [bad.message_id]
    assert report.held_back == [a2.message_id]
    assert len(report.missing) == 1 and "pruned" in store.refusals[report.missing[0]]
    assert report.left == 3


def test_batches_are_numbered_after_the_last_committed_one() -> None:
    events = [event(n, f"k{n}") for n in range(1, 6)]
    store = FakeStore(events, used_batches=4)
    publisher = FakePublisher(committed=7)  # a crashed redrive committed batch 7
    report = redrive(store, publisher, batch_size=2)
    assert store.calls[0] == ("settle", 7)
    assert [c[1] for c in store.calls if c[0] == "done"] == [8, 9, 10]
    assert publisher.committed == [ids(*events[:2]), ids(*events[2:4]), ids(events[4])]
    assert report.redriven == 5 and report.left == 0


@pytest.mark.parametrize("used", [0, 12])
def test_numbers_never_go_back_below_the_ones_postgres_used(used: int) -> None:
    store = FakeStore([event(1, "a")], used_batches=used)
    redrive(store, FakePublisher(committed=3))
    assert ("done", max(3, used) + 1) in store.calls


def test_a_still_poison_events_error_is_cut_where_it_is_stored_and_reported() -> None:
    """Issue #47: an error may quote the row (here a 2 KB topic name); a redrive of a
    flood stores and reports each, so each is cut as the relay cuts its own."""
    still = event(1, "a")._replace(aggregate_type="bad type " + "x" * 2000)
    store = FakeStore([still])
    report = redrive(store, FakePublisher())
    [error] = report.still_poison.values()
    assert len(error.encode()) <= MAX_STORED_ERROR_BYTES and "...[cut: " in error
    assert store.refusals[still.message_id] == error
