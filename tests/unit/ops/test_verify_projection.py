"""``verify --through projection``: each order's row at its last expected event; rows
of older events missing, quarantined ones apart, rows at no committed event found
(over the in-memory projection)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID, uuid4

import pytest

from relay.adapters.memory import InMemoryProjection
from relay.core.model import Position
from relay.core.ports import EventKeys, ProjectedRow, ProjectionRead, PublishedEvent
from relay.core.subscribers import Subscriber
from relay.ops.verify_projection import verify_projection
from tests.unit.ops.test_verify_sink import Store

# (position, aggregate type, aggregate id, payload) of the subscriber's expected events.
Event = tuple[Position, str, str, dict[str, Any]]


class Outbox:
    """The events verify expects of subscriber s (up to its checkpoint), and others past
    it (``ahead``)."""

    def __init__(self, events: Sequence[Event], ahead: Sequence[Event] = ()) -> None:
        self._ids = {e[0]: uuid4() for e in (*events, *ahead)}
        self._events, self._ahead = list(events), {e[0] for e in ahead}
        self._all = {self._ids[e[0]]: e for e in (*events, *ahead)}

    def published_events(self, subscriber: Subscriber) -> Iterator[PublishedEvent]:
        for at, aggregate_type, _, _ in self._events:
            yield PublishedEvent(self._ids[at], at, aggregate_type, "OrderPlaced", False, False, 0)

    def part_starts(self, name: str) -> list[tuple[int, Position]]:
        return []

    def placed(self, name: str, ids: Sequence[UUID]) -> dict[UUID, str]:
        return {mid: "ahead" for mid in ids if self._all[mid][0] in self._ahead}

    def event_keys(self, ids: Sequence[UUID], field: str) -> dict[UUID, EventKeys]:
        found = {mid: self._all[mid] for mid in ids if mid in self._all}
        return {
            mid: EventKeys(kind, "OrderPlaced", aggregate_id, payload.get(field))
            for mid, (_, kind, aggregate_id, payload) in found.items()
        }

    def message_ids_at(self, positions: Sequence[Position]) -> dict[Position, UUID]:
        return {at: self._ids[at] for at in positions if at in self._ids}


def order(tx: int, key: str, kind: str = "order") -> Event:
    return Position(tx, 0), kind, key, {"order_id": key}


def check(outbox: Outbox, projection: InMemoryProjection) -> Any:
    (report,) = verify_projection(Store(), outbox, projection, "projection")  # type: ignore[arg-type]
    return report


def test_rows_at_each_orders_last_event_are_clean() -> None:
    projection = InMemoryProjection()
    projection.held = {"a": Position(3, 0), "b": Position(2, 0)}
    report = check(Outbox([order(1, "a"), order(2, "b"), order(3, "a")]), projection)
    assert (report.expected, report.found, report.missing, report.not_in_outbox) == (2, 2, 0, 0)
    assert report.verdict == "clean"


def test_events_of_other_aggregates_are_not_the_projections() -> None:
    projection = InMemoryProjection()
    projection.held = {"a": Position(1, 0)}
    report = check(Outbox([order(1, "a"), order(2, "x", kind="payment")]), projection)
    assert (report.expected, report.found) == (1, 1)


def test_no_row_or_an_older_events_row_is_missing() -> None:
    projection = InMemoryProjection()
    projection.held = {"a": Position(1, 0)}  # a's second event not applied; b not at all
    report = check(Outbox([order(1, "a"), order(2, "b"), order(3, "a")]), projection)
    assert (report.expected, report.found, report.missing) == (2, 0, 2)
    assert report.problems
    assert [t.split(":")[0] for t in report.examples["missing"]] == ["a", "b"]


def test_quarantined_events_are_not_missing() -> None:
    projection = InMemoryProjection()
    projection.held = {"a": Position(1, 0)}
    projection.quarantined = {"a", "no-id"}  # a's last event, and one without an order_id
    no_id = (Position(4, 0), "order", "no-id", {"customer_id": "c"})
    report = check(Outbox([order(1, "a"), order(3, "a"), no_id]), projection)
    assert (report.expected, report.found, report.missing, report.quarantined) == (1, 0, 0, 2)
    assert report.verdict == "clean"


def test_an_event_without_a_key_neither_applied_nor_quarantined_is_missing() -> None:
    no_id = (Position(4, 0), "order", "no-id", {"customer_id": "c"})
    report = check(Outbox([no_id]), InMemoryProjection())
    assert report.missing == 1 and "no order_id" in report.examples["missing"][0]


def test_a_row_at_no_committed_event_is_not_in_outbox_and_one_ahead_is_apart() -> None:
    projection = InMemoryProjection()
    # a: a rolled-back transaction's event; b: past the checkpoint; c: no such order.
    projection.held = {"a": Position(9, 0), "b": Position(5, 0), "c": Position(8, 0)}
    outbox = Outbox([order(1, "a"), order(2, "b")], ahead=[order(5, "b")])
    report = check(outbox, projection)
    assert (report.expected, report.found, report.missing) == (2, 0, 0)
    assert (report.not_in_outbox, report.ahead) == (2, 1)
    assert report.examples["not_in_outbox"] == [
        "a: its row at 9:0, no committed event there",
        "c: its row at 8:0, no committed event there",
    ]
    assert report.problems


def test_the_reader_expects_the_events_the_job_applies() -> None:
    """The reader names the job's event types itself (the job may not import the relay's
    Postgres adapters): the two must agree."""
    job = pytest.importorskip("spark_jobs.order_projection")
    from relay.adapters.postgres.projection import OrderProjection

    reader = OrderProjection("postgresql://verify@db/app")
    assert all(reader.projects("order", f"app.{kind}") for kind in job._STATUS)
    assert not reader.projects("order", "OrderCancelled")
    assert not reader.projects("payment", "OrderPlaced")


def test_rows_are_placed_a_chunk_at_a_time_and_listed_after_the_keys_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows are streamed: those to place are kept a chunk at a time, not the table;
    the report reads as when they were all held (missing keys' examples first)."""
    monkeypatch.setattr("relay.ops.verify_projection._CHUNK", 2)
    projection = InMemoryProjection()
    projection.held = {f"ghost-{n}": Position(100 + n, 0) for n in range(5)}
    projection.held["b"] = Position(7, 0)  # past b's checkpoint
    outbox = Outbox([order(1, "a"), order(2, "b")], ahead=[order(7, "b")])
    report = check(outbox, projection)
    assert (report.expected, report.missing, report.not_in_outbox, report.ahead) == (2, 1, 5, 1)
    assert list(report.as_dict()["examples"]) == ["missing", "not_in_outbox"]
    assert report.examples["not_in_outbox"] == [
        f"ghost-{n}: its row at {100 + n}:0, no committed event there" for n in range(5)
    ]


def test_the_rows_are_read_within_one_read() -> None:
    """One read of the projection (one connection, for the Postgres reader) gives both
    the quarantined keys and the rows, read before it ends."""
    reads: list[str] = []

    class Once(InMemoryProjection):
        @contextmanager
        def read(self) -> Iterator[ProjectionRead]:
            reads.append("open")

            def rows(read: ProjectionRead) -> Iterator[ProjectedRow]:
                for row in read.rows:
                    reads.append("row")
                    yield row

            with super().read() as read:
                yield read._replace(rows=rows(read))
            reads.append("closed")

    projection = Once()
    projection.held = {"a": Position(1, 0)}
    assert check(Outbox([order(1, "a")]), projection).found == 1
    assert reads == ["open", "row", "closed"]
