"""``outbox-relay verify --through projection``: a projection against the outbox.

A projection keeps one row per key (the order projection: an order), upserted only by
a newer ``(transaction_id, position)``; it holds no event ids. So "exactly the committed
events" means: for each key among the events verify expects of the subscriber (up to
each part's checkpoint, :func:`relay.ops.verify.expectations`) that the projection
applies, its row is there at the key's *last* expected event. Reported: *missing* (no
row, or a row of an older event), *quarantined* (the projection's error table holds a
record of the key's events: not applied, on purpose; an event without the key, the
same), *not in outbox* (a row at no committed event: a rolled-back transaction's, or a
row pruned since), and apart, rows past a checkpoint (*ahead*) or outside the
subscriber's range (*outside range*). The error table keeps Kafka coordinates and record
keys, not event ids: a key's events are taken as quarantined by their record key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar
from uuid import UUID

from relay.core.model import Position
from relay.core.ports import (
    EventKeys,
    ProjectedRow,
    ProjectionRead,
    ProjectionReader,
    SubscriberState,
    VerifyOutbox,
)
from relay.ops.verify import Expected, VerifyStore, expectations, selected
from relay.ops.verify_sink import MAX_EXAMPLES, SinkFindings, place_held

_CHUNK = 10_000  # ids or positions looked up per query


@dataclass
class ProjectionReport(SinkFindings):
    PROBLEMS: ClassVar[tuple[str, ...]] = ("missing", "not_in_outbox")
    expected: int = 0  # keys the subscriber's expected events name
    found: int = 0  # rows at their key's last expected event
    missing: int = 0
    quarantined: int = 0
    not_in_outbox: int = 0
    ahead: int = 0
    outside_range: int = 0


@dataclass(slots=True)
class _Last:
    """A key's last expected event, the record keys of all its events, and where the
    key's row is (None: no row, or not read yet)."""

    at: Position
    message_id: UUID
    record_keys: set[str] = field(default_factory=set)
    row: Position | None = None


@dataclass
class _Check:
    """One subscriber's check, fed the projection's rows as they are read: what it holds
    is its keys' last events and a chunk of rows to place, not the table."""

    outbox: VerifyOutbox
    report: ProjectionReport
    last: dict[str, _Last]
    strays: list[ProjectedRow] = field(default_factory=list)
    # The examples of rows not in the outbox, given after those of the keys' own rows.
    not_in_outbox: list[str] = field(default_factory=list)

    def see(self, row: ProjectedRow) -> None:
        """Note the row at its key's last event, or keep it to place: a key with no
        expected event, or a row past its key's last one."""
        event = self.last.get(row.key)
        if event is not None:
            event.row = row.at
        if event is None or row.at > event.at:
            self.strays.append(row)
            if len(self.strays) >= _CHUNK:
                self.place()

    def place(self) -> None:
        """Count the rows kept by where their event lies."""
        if not self.strays:
            return
        ids = self.outbox.message_ids_at([at for _, at in self.strays])
        held = [(row, ids.get(row.at)) for row in self.strays]
        for key, at in place_held(self.outbox, self.report, held):
            if len(self.not_in_outbox) < MAX_EXAMPLES:
                self.not_in_outbox.append(f"{key}: its row at {at}, no committed event there")
        self.strays = []

    def finish(self, quarantined: set[str]) -> ProjectionReport:
        self.place()
        _compare(self.report, self.last, quarantined)
        for text in self.not_in_outbox:
            self.report.example("not_in_outbox", text)
        return self.report


def verify_projection(
    store: VerifyStore,
    outbox: VerifyOutbox,
    projection: ProjectionReader,
    sink_name: str,
    *,
    subscribers: Sequence[str] | None = None,
) -> list[ProjectionReport]:
    """One report per subscriber (all unless ``subscribers`` names some); the
    projection is read once, on one connection, its rows streamed past every
    subscriber's check."""
    states = selected(store, subscribers)
    with projection.read() as read:
        checks = [_expect(outbox, projection, store, state, sink_name, read) for state in states]
        for row in read.rows:
            for check in checks:
                check.see(row)
    return [check.finish(read.quarantined) for check in checks]


def _expect(
    outbox: VerifyOutbox,
    projection: ProjectionReader,
    store: VerifyStore,
    state: SubscriberState,
    sink_name: str,
    read: ProjectionRead,
) -> _Check:
    _, expected = expectations(outbox, state, store.operator_skips(state.subscriber_id))
    report = ProjectionReport(state.subscriber.name, sink_name)
    last = _last_events(outbox, projection, expected, report, read.quarantined)
    return _Check(outbox, report, last)


def _last_events(
    outbox: VerifyOutbox,
    projection: ProjectionReader,
    expected: Expected,
    report: ProjectionReport,
    quarantined: set[str],
) -> dict[str, _Last]:
    """Each key's last expected event; an applicable event without a key is counted
    here (quarantined, or missing: the projection neither applied nor quarantined it)."""
    last: dict[str, _Last] = {}
    for mid, keys in _event_keys(outbox, list(expected.positions), projection.key_field):
        if not projection.projects(keys.aggregate_type, keys.event_type):
            continue
        if keys.field is None:
            _count_unkeyed(report, mid, keys, quarantined, projection.key_field)
            continue
        at = expected.positions[mid.bytes]
        seen = last.get(keys.field)
        if seen is None or at > seen.at:
            last[keys.field] = _Last(at, mid, seen.record_keys if seen else set())
        last[keys.field].record_keys.add(keys.aggregate_id)
    report.expected = len(last)
    return last


def _count_unkeyed(
    report: ProjectionReport, mid: UUID, keys: EventKeys, quarantined: set[str], key_field: str
) -> None:
    if keys.aggregate_id in quarantined:
        report.quarantined += 1
        report.example("quarantined", f"{mid} (no {key_field})")
    else:
        report.missing += 1
        report.example("missing", f"{mid}: no {key_field}, and not quarantined")


def _compare(report: ProjectionReport, last: dict[str, _Last], quarantined: set[str]) -> None:
    """Count each key's row against its last event (a row past it: placed)."""
    for key, event in last.items():
        at = event.row
        row = "no row" if at is None else f"its row at {at}"
        if at == event.at:
            report.found += 1
        elif at is not None and at > event.at:
            continue  # placed with the strays
        elif event.record_keys & quarantined:
            report.quarantined += 1
            report.example("quarantined", f"{key}: {row}, its events quarantined")
        else:
            report.missing += 1
            report.example(
                "missing", f"{key}: {row}, its last event {event.message_id} at {event.at}"
            )


def _event_keys(
    outbox: VerifyOutbox, ids: list[bytes], key_field: str
) -> Iterator[tuple[UUID, EventKeys]]:
    for start in range(0, len(ids), _CHUNK):
        chunk = [UUID(bytes=mid) for mid in ids[start : start + _CHUNK]]
        yield from outbox.event_keys(chunk, key_field).items()
