"""A replay's range and its record on the ledger (docs/design.md §7, "Replay"): what
``subscribers replay`` (relay/ops/replay.py) publishes again, what the Postgres adapter
reads of the replays (relay/adapters/postgres/replay_store.py), and what verify checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from relay.core.model import RESERVED_HEADER_PREFIX, OutboxEvent, Position
from relay.core.ports import Selection
from relay.core.subscribers import Subscriber, legal_topic
from relay.errors import SubscriberError

# The header that marks a replayed record, with the replay's ledger entry id (under the
# relay's reserved prefix: a row's own header of that name is dropped, so no row can
# pass for a replay).
HEADER_REPLAY = RESERVED_HEADER_PREFIX + "replay"


def _narrowed(
    subscribers: frozenset[str] | None, asked: Sequence[str] | None
) -> frozenset[str] | None:
    """What both a subscriber's filter and the replay's take (None: any)."""
    if not asked:
        return subscribers
    given = frozenset(asked)
    return given if subscribers is None else subscribers & given


@dataclass(frozen=True)
class ReplayRange:
    """What a replay republishes: the events of ``[start, end]`` (both included) that the
    subscriber's filters, narrowed by ``aggregate_types`` and ``event_types``, match;
    into the topic ``into`` (None: the subscriber's own topics)."""

    start: Position
    end: Position
    into: str | None = None
    aggregate_types: frozenset[str] | None = None
    event_types: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.start > self.end:
            raise SubscriberError(
                f"--from {self.start} is after --to {self.end}: nothing to replay"
            )
        if self.into is not None and not legal_topic(self.into):
            raise SubscriberError(
                f"--into {self.into!r} is not a legal Kafka topic name "
                "(1-249 of [a-zA-Z0-9._-], not '.' or '..')"
            )

    @classmethod
    def of(
        cls,
        subscriber: Subscriber,
        start: Position,
        end: Position,
        into: str | None,
        aggregate_types: Sequence[str] | None = None,
        event_types: Sequence[str] | None = None,
    ) -> ReplayRange:
        """The range of ``subscriber``'s events the operator asked for."""
        return cls(
            start,
            end,
            into,
            _narrowed(subscriber.aggregate_types, aggregate_types),
            _narrowed(subscriber.event_types, event_types),
        )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ReplayRange:
        """The range a ledger entry's ``args`` record (:meth:`args`)."""
        types = args.get("aggregate_types")
        events = args.get("event_types")
        return cls(
            Position.parse(args["from"]),
            Position.parse(args["to"]),
            args.get("into"),
            None if types is None else frozenset(types),
            None if events is None else frozenset(events),
        )

    def args(self) -> dict[str, Any]:
        """The replay's identity on the ledger: a run with the same args goes on with it."""
        return {
            "from": str(self.start),
            "to": str(self.end),
            "into": self.into,
            "aggregate_types": None
            if self.aggregate_types is None
            else sorted(self.aggregate_types),
            "event_types": None if self.event_types is None else sorted(self.event_types),
        }

    def query_params(self) -> dict[str, Any]:
        return {
            "start_transaction_id": self.start.transaction_id,
            "start_position": self.start.position,
            "end_transaction_id": self.end.transaction_id,
            "end_position": self.end.position,
            "aggregate_types": self.args()["aggregate_types"],
            "event_types": self.args()["event_types"],
        }

    def covers(self, event: OutboxEvent) -> bool:
        """Whether ``event`` is one of the range's: within it, and taken by its filters."""
        return (
            self.start <= event.key <= self.end
            and (self.aggregate_types is None or event.aggregate_type in self.aggregate_types)
            and (self.event_types is None or event.event_type in self.event_types)
        )

    def selection(self, limit: int, max_bytes: int, *, raw_payloads: bool = False) -> Selection:
        """What each fetch reads; ``raw_payloads`` as the subscriber's format takes them,
        so a replay publishes the bytes the relay published (issue #53)."""
        return Selection(
            limit,
            max_bytes,
            aggregate_types=self.aggregate_types,
            event_types=self.event_types,
            raw_payloads=raw_payloads,
        )

    def before_start(self) -> Position:
        """The key just before the range: fetches read after it."""
        return Position(self.start.transaction_id, self.start.position - 1)

    def publisher_of(self, subscriber: Subscriber) -> Subscriber:
        """The subscriber whose encoding the records take: its own, with the topic
        ``into`` (so a registry's subject follows the topic, as for the relay)."""
        if self.into is None:
            return subscriber
        return dataclasses.replace(subscriber, topic=self.into)

    def describe(self) -> str:
        filters = [
            f"{what} {', '.join(sorted(values))}"
            for what, values in (
                ("aggregate types", self.aggregate_types),
                ("event types", self.event_types),
            )
            if values is not None
        ]
        where = f"into topic {self.into!r}" if self.into else "into the subscriber's own topics"
        narrowed = f" of {'; '.join(filters)}" if filters else ""
        return f"events [{self.start}, {self.end}]{narrowed}, {where}"


@dataclass(frozen=True)
class OpenReplay:
    """A replay on the ledger: its 'start' entry, its range, and whether it is done."""

    entry: int
    wanted: ReplayRange
    events: int
    done: bool


def unfinished(replays: Iterable[OpenReplay], wanted: ReplayRange) -> OpenReplay | None:
    """The latest of ``replays`` with the arguments ``wanted`` that has not finished."""
    return next((r for r in reversed(list(replays)) if not r.done and r.wanted == wanted), None)
