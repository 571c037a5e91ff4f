"""``outbox-relay verify``: compare the outbox with what is on the topics.

For each subscriber, every event at or before its part's checkpoint (and matching its
filter) must be on its topic exactly once, and each key's records must appear in
``(transaction_id, position)`` order. Topics are read read_committed, from the start
of the log to its end as of the start of the run.

Records found past a part's checkpoint are reported as *ahead* (a transaction that
committed before its Postgres checkpoint update: the next owner adopts it), not as
errors. Records of events at or before a part's start (published before a reset) and
records whose rows were pruned are counted apart, so *ahead* is the crash window only.
Events the operator skipped, read from the ledger (migration 0019: the range of every
reset forward, and every event of ``subscribers skip``, across any number of later
resets), are *skipped by operator*, each with its ledger entry: neither missing nor
clean (the verdict says so, and the command exits 4). An event skipped while a batch
holding it was already on its way is found on the topic: reported apart
(``published_despite_skip``), not as a skip. A checkpoint beyond the horizon, which
skips every event written from then on, is a finding. After ``subscribers reset`` to
an earlier point, republished events are duplicates by design; verify a fresh
subscriber instead. A dead-lettered event that ``dead-letters redrive`` published must
be there exactly once too, after its key's later events: its order is checked only
among the redriven events. Replayed records (``subscribers replay``: the header
``outbox.replay``) are checked apart, per replay: every event of a finished replay's
range that its filters match must be on its topic exactly once with the replay's
header; an open (interrupted) replay is reported as such, not checked.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from relay.core.formats import format_of
from relay.core.interventions import OperatorSkip
from relay.core.log_fields import log_extra
from relay.core.model import ConsumedRecord, Position
from relay.core.ports import LagStore, ReplayedRanges, SubscriberState, TopicReader, VerifyOutbox
from relay.core.replay import HEADER_REPLAY
from relay.errors import SubscriberError
from relay.ops.lag import subscriber_lag

logger = logging.getLogger(__name__)

_MAX_EXAMPLES = 20  # findings listed per kind; the counts are always complete
_PLACE_CHUNK = 10_000  # message ids looked up per query


@dataclass
class SubscriberReport:
    subscriber: str
    topics: list[str]
    expected: int = 0
    found: int = 0
    missing: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    ahead: int = 0  # published past the Postgres checkpoint (recovery adopts them)
    before_start: int = 0  # records of events at or before the part's start (before a reset)
    not_in_outbox: int = 0  # records whose rows are gone (pruned) or outside the filters
    # Events the operator skipped: never published, by every reset forward (and a
    # checkpoint beyond the horizon) and every `subscribers skip`; the entries that did.
    skipped_by_reset: int = 0
    skipped_by_skip: int = 0
    skips: list[OperatorSkip] = field(default_factory=list)
    published_despite_skip: int = 0  # skipped while their batch was on its way
    beyond_horizon: list[int] = field(default_factory=list)  # parts no new row can reach
    dead_lettered: int = 0
    redriven: int = 0  # dead-lettered, then redriven: expected (and counted in expected)
    pending: int = 0  # not yet published: after the checkpoint
    pending_estimated: bool = False  # pending is an estimate (relay/ops/lag.py)
    # Parts created with --from now or reset since: events before these are not checked.
    checked_after: list[str] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    replays: list[ReplayCheck] = field(default_factory=list)

    @property
    def problems(self) -> bool:
        """Events lost, doubled or out of order, or a checkpoint no new row can reach;
        or a replay's events missing or doubled."""
        lost = self.missing or self.duplicated or self.out_of_order or self.beyond_horizon
        return bool(lost) or any(r.problems for r in self.replays)

    @property
    def skipped_by_operator(self) -> int:
        return self.skipped_by_reset + self.skipped_by_skip

    @property
    def clean(self) -> bool:
        """No problem, and nothing skipped by the operator (never passed for clean)."""
        return not self.problems and not self.skipped_by_operator

    @property
    def verdict(self) -> str:
        if self.problems:
            return "problems"
        return "skipped by operator" if self.skipped_by_operator else "clean"

    def example(self, kind: str, text: str) -> None:
        if len(self.examples[kind]) < _MAX_EXAMPLES:
            self.examples[kind].append(text)

    def as_dict(self) -> dict[str, Any]:
        return {
            "subscriber": self.subscriber,
            "topics": self.topics,
            "expected": self.expected,
            "found": self.found,
            "missing": self.missing,
            "duplicated": self.duplicated,
            "out_of_order": self.out_of_order,
            "ahead": self.ahead,
            "before_start": self.before_start,
            "not_in_outbox": self.not_in_outbox,
            "skipped_by_operator": self.skipped_by_operator,
            "skipped_by_reset": self.skipped_by_reset,
            "skipped_by_skip": self.skipped_by_skip,
            "skips": [k.as_dict() for k in self.skips],
            "published_despite_skip": self.published_despite_skip,
            "beyond_horizon": self.beyond_horizon,
            "dead_lettered": self.dead_lettered,
            "redriven": self.redriven,
            "pending": self.pending,
            "pending_estimated": self.pending_estimated,
            "checked_after": self.checked_after,
            "problems": self.problems,
            "clean": self.clean,
            "verdict": self.verdict,
            "examples": dict(self.examples),
            "replays": [r.as_dict() for r in self.replays],
        }


@dataclass
class ReplayCheck:
    """One replay of a subscriber (its ledger entry), checked on its topics."""

    entry: int
    what: str  # its range, filters and topic
    done: bool  # False: interrupted, not checked (run it again to finish it)
    expected: int = 0
    found: int = 0
    missing: int = 0
    duplicated: int = 0

    @property
    def problems(self) -> bool:
        return bool(self.missing or self.duplicated)

    def describe(self) -> str:
        if not self.done:
            return f"replay #{self.entry} ({self.what}): open, interrupted; not checked"
        return (
            f"replay #{self.entry} ({self.what}): expected {self.expected}, found "
            f"{self.found}, missing {self.missing}, duplicated {self.duplicated}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "what": self.what,
            "done": self.done,
            "expected": self.expected,
            "found": self.found,
            "missing": self.missing,
            "duplicated": self.duplicated,
            "problems": self.problems,
        }


@dataclass
class Expected:
    """Compact expectations: message id bytes → its key in the outbox."""

    positions: dict[bytes, Position] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)
    topic_of: dict[bytes, str] = field(default_factory=dict)  # the expected events routed
    redriven: set[bytes] = field(default_factory=set)  # published after their key's later events
    # Skipped by `subscribers skip` (not expected): message id → its ledger entry.
    skipped: dict[bytes, OperatorSkip] = field(default_factory=dict)
    # A subscriber with routing control: each event's part. Its key may be coarser than
    # the aggregate, and then order holds per key within each part only (docs/design.md
    # §2, "Another record key"); None: the key is the aggregate id.
    parts: dict[bytes, int] | None = None


class VerifyStore(LagStore, Protocol):
    """What verify reads of the outbox's subscribers through the store port (the rest,
    the events expected on the topics, it reads through :class:`VerifyOutbox`)."""

    def operator_skips(self, subscriber_id: UUID) -> list[OperatorSkip]:
        """What the operator skipped of the subscriber, per ledger entry and part."""


def verify(
    store: VerifyStore,
    outbox: VerifyOutbox,
    reader: TopicReader,
    *,
    subscribers: Sequence[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SubscriberReport]:
    """One report per subscriber (all of them unless ``subscribers`` names some);
    ``store`` and ``outbox`` are the composition root's (``relay.wiring``), on one
    connection."""
    reports = []
    for state in selected(store, subscribers):
        name = state.subscriber.name
        skips = store.operator_skips(state.subscriber_id)
        report, expected = expectations(outbox, state, skips)
        lag = subscriber_lag(store, state)
        report.pending, report.pending_estimated = lag.events, lag.estimated

        def tick(done: int, total: int, name: str = name) -> None:
            if progress is not None:
                progress(name, done, total)

        outside = _compare(report, expected, reader.read(sorted(expected.topics), tick))
        _place(outbox, report, outside)
        _skips(store, report, skips)
        report.replays = _replays(outbox, state, reader)
        reports.append(report)
    return reports


def selected(store: VerifyStore, subscribers: Sequence[str] | None) -> list[SubscriberState]:
    """The subscribers to check: all of them unless ``subscribers`` names some (each
    must exist), but those verify cannot check (:func:`_checkable`)."""
    states = [s for s in store.list() if subscribers is None or s.subscriber.name in subscribers]
    unknown = set(subscribers or ()) - {s.subscriber.name for s in states}
    if unknown:
        raise SubscriberError(f"no subscriber named {sorted(unknown)}")
    return _checkable(states, named=subscribers is not None)


def _replays(
    replays: ReplayedRanges, state: SubscriberState, reader: TopicReader
) -> list[ReplayCheck]:
    """Each replay of the subscriber: a finished one's events, each once on its topic
    with its header (records of other replays and the relay's own are not its)."""
    checks = []
    for found in replays.replays(state.subscriber_id):
        wanted = found.wanted
        check = ReplayCheck(found.entry, wanted.describe(), found.done)
        checks.append(check)
        if not found.done:
            continue
        events = replays.events(wanted)
        expected = {mid.bytes for mid, _, _, _ in events}
        check.expected = len(expected)
        if wanted.into is not None:
            topics = {wanted.into}
        else:
            routed = (state.subscriber.route(a, e) for _, _, a, e in events)
            topics = {t for t in routed if t is not None}
        mark = str(found.entry).encode()
        seen: set[bytes] = set()
        for record in reader.read(sorted(topics)):
            if record.header(HEADER_REPLAY) != mark or record.message_id is None:
                continue
            try:
                mid = UUID(record.message_id).bytes
            except ValueError:
                continue  # not a record the relay wrote
            if mid in seen:
                check.duplicated += 1
            elif mid in expected:
                seen.add(mid)
        check.found = len(seen)
        check.missing = len(expected - seen)
    return checks


def _checkable(states: list[SubscriberState], *, named: bool) -> list[SubscriberState]:
    """Records of the debezium format carry Debezium's headers only (no message id or
    position of the relay's), so verify cannot tell them apart: it says so."""
    debezium = [
        s.subscriber.name for s in states if not format_of(s.subscriber.value_format).relay_headers
    ]
    if debezium and named:
        raise SubscriberError(
            f"cannot verify {debezium}: the debezium format carries no relay headers"
        )
    for name in debezium:
        logger.warning(
            "not verified: subscriber %s (the debezium format carries no relay headers)",
            name,
            extra=log_extra("verify_skipped_debezium", subscriber=name),
        )
    return [s for s in states if s.subscriber.name not in debezium]


def expectations(
    outbox: VerifyOutbox,
    state: SubscriberState,
    skips: list[OperatorSkip],
) -> tuple[SubscriberReport, Expected]:
    subscriber = state.subscriber
    expected = Expected(parts=None if subscriber.routing.default else {})
    skipped = {k.message_id.bytes: k for k in skips if k.message_id is not None}
    if subscriber.fixed_topic is not None:  # read even when nothing is expected on it
        expected.topics.add(subscriber.fixed_topic)
    report = SubscriberReport(subscriber.name, [])
    for event in outbox.published_events(subscriber):
        mid = event.message_id.bytes
        if expected.parts is not None:
            expected.parts[mid] = event.part
        if mid in skipped:
            expected.skipped[mid] = skipped[mid]
            continue
        if event.dead_lettered and not event.redriven:
            report.dead_lettered += 1
            continue
        if event.redriven:
            report.redriven += 1
            expected.redriven.add(mid)
        # None: no legal topic, so nothing was published (and the event is missing).
        topic = subscriber.route(event.aggregate_type, event.event_type)
        if topic is not None:
            expected.topics.add(topic)
            expected.topic_of[mid] = topic
        expected.positions[mid] = event.key
    starts = outbox.part_starts(subscriber.name)
    report.checked_after = [f"part {part} at {start}" for part, start in starts]
    report.expected = len(expected.positions)
    report.topics = sorted(expected.topics)
    return report, expected


def _skips(store: VerifyStore, report: SubscriberReport, skips: list[OperatorSkip]) -> None:
    """What the operator skipped, with the ledger entries; what a skip came too late for
    (``published_despite_skip``, counted by :func:`_compare`) is not skipped."""
    report.skips = skips
    for part in store.part_skips(report.subscriber, None):
        report.skipped_by_reset += (part.counted or 0) + part.by_reset
        report.skipped_by_skip += part.by_skip
        if part.beyond_horizon:
            report.beyond_horizon.append(part.part)
            report.example(
                "beyond_horizon",
                f"part {part.part}: its checkpoint is beyond what the database has decided, "
                "so every event written from now on is skipped; reset it to 'now'",
            )
    report.skipped_by_skip -= report.published_despite_skip


def placements(
    outbox: VerifyOutbox, subscriber: str, ids: list[UUID]
) -> Iterator[tuple[UUID, str | None]]:
    """Where each id's row lies for the subscriber (:meth:`VerifyOutbox.placed`; None:
    it has no row), looked up a chunk at a time."""
    for start in range(0, len(ids), _PLACE_CHUNK):
        chunk = ids[start : start + _PLACE_CHUNK]
        placed = outbox.placed(subscriber, chunk)
        yield from ((mid, placed.get(mid)) for mid in chunk)


def _place(outbox: VerifyOutbox, report: SubscriberReport, outside: list[UUID]) -> None:
    """Count the records found outside the expected range by where their rows lie."""
    for _, where in placements(outbox, report.subscriber, outside):
        if where == "ahead":
            report.ahead += 1
        elif where == "before_start":
            report.before_start += 1
        else:
            report.not_in_outbox += 1


def _compare(
    report: SubscriberReport, expected: Expected, records: Iterable[ConsumedRecord]
) -> list[UUID]:
    """Compare, and return the ids of records outside the expected range (once each)."""
    outside: dict[bytes, None] = {}
    seen: set[bytes] = set()
    last_by_key: dict[tuple[str, int, bytes | None, int], Position] = {}
    # Redriven events follow their key's later events: checked among themselves only.
    last_redriven_by_key: dict[tuple[str, int, bytes | None, int], Position] = {}
    parts = expected.parts
    for record in records:
        if record.message_id is None or record.position is None:
            continue  # not written by the relay
        if record.header(HEADER_REPLAY) is not None:
            continue  # a replay's: checked with its replay
        try:
            mid = UUID(record.message_id).bytes
        except ValueError:
            continue
        # Order by the event's key in the database, not the one in its headers: after a
        # move to another xid space (docs/design.md) the database rebased its keys, and
        # records published before the move carry the old ones.
        late = expected.skipped.get(mid)
        if late is not None:
            report.published_despite_skip += 1
            report.example(
                "published_despite_skip",
                f"{record.message_id} at {record.topic}[{record.partition}]@{record.offset}: "
                f"skipped by ledger #{late.entry.id} while its batch was on its way",
            )
            continue
        at = expected.positions.get(mid)
        key = (
            record.topic,
            record.partition,
            record.key,
            0 if parts is None else parts.get(mid, 0),
        )
        order = last_redriven_by_key if mid in expected.redriven else last_by_key
        previous = order.get(key)
        if at is not None and previous is not None and at <= previous:
            report.out_of_order += 1
            report.example(
                "out_of_order",
                f"{record.topic}[{record.partition}]@{record.offset} key {record.key!r}: "
                f"{at} after {previous}",
            )
        if at is not None:
            order[key] = at
        if mid not in expected.positions:
            outside[mid] = None
            continue
        if mid in seen:
            report.duplicated += 1
            report.example(
                "duplicated",
                f"{record.message_id} again at {record.topic}[{record.partition}]@{record.offset}",
            )
            continue
        seen.add(mid)
        report.found += 1
    for mid, position in expected.positions.items():
        if mid not in seen:
            report.missing += 1
            report.example("missing", f"{UUID(bytes=mid)} (position {position})")
    return [UUID(bytes=mid) for mid in outside]
