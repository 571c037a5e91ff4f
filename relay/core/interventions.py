"""The ledger of interventions: every operator action that changes what a subscriber
publishes, with who, when, what and how many events (docs/design.md §1, "Resets",
and §7, "Skipping one event").

An :class:`Intervention` is what a command records (``OutboxStore.record``, or with its
change in one transaction); a :class:`Recorded` is a ledger entry as read back, and an
:class:`OperatorSkip` what one entry skipped of one part; a :class:`SkipTarget` what
``subscribers skip`` checks of an event before it skips it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple
from uuid import UUID

from relay.core.model import Position
from relay.core.subscribers import StartFrom
from relay.errors import SubscriberError


class Action(StrEnum):
    """What an operator did (the ledger's ``action``; migration 0019 lists the same)."""

    ADD = "add"
    REPLACE = "replace"
    SET = "set"
    PAUSE = "pause"
    RESUME = "resume"
    RESET = "reset"
    SKIP = "skip"
    REMOVE = "remove"
    REDRIVE = "redrive"
    REPLAY = "replay"
    PRUNE = "prune"  # dead letters deleted before their redrive


@dataclass(frozen=True)
class Actor:
    """Who acts, as the command line reports it. The database role is the ledger's own
    (``session_user``): a client cannot write it."""

    os_user: str | None = None
    host: str | None = None


@dataclass(frozen=True)
class Intervention:
    """An entry to record: ``params`` are the action's parameters (plain JSON values:
    positions as ``TXID:POS`` text, message ids as text, definitions before and
    after), ``events`` how many events it skipped or republishes (None: not counted)."""

    action: Action
    subscriber: str
    subscriber_id: UUID | None
    actor: Actor = Actor()
    params: dict[str, Any] = field(default_factory=dict)
    events: int | None = None


@dataclass(frozen=True)
class Recorded:
    """A ledger entry as read back."""

    id: int
    subscriber: str
    subscriber_id: UUID | None
    action: Action
    recorded_at: datetime
    db_role: str
    os_user: str | None
    host: str | None
    params: dict[str, Any]
    events: int | None

    @property
    def who(self) -> str:
        """``os_user@host as db_role``, with what is known."""
        where = "@".join(p for p in (self.os_user, self.host) if p)
        return f"{where} as {self.db_role}" if where else self.db_role

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "subscriber": self.subscriber,
            "subscriber_id": None if self.subscriber_id is None else str(self.subscriber_id),
            "action": self.action.value,
            "recorded_at": self.recorded_at.isoformat(),
            "db_role": self.db_role,
            "os_user": self.os_user,
            "host": self.host,
            "params": self.params,
            "events": self.events,
        }


@dataclass(frozen=True)
class OperatorSkip:
    """What one ledger entry skipped of one part: one event (``message_id``), or the
    range a reset forward jumped over, ``(after, upto]``, with ``events`` of the part's
    events in it that the subscriber's filters match."""

    entry: Recorded
    part: int
    events: int
    message_id: UUID | None = None
    after: Position | None = None
    upto: Position | None = None

    def describe(self) -> str:
        """One line for an operator: what, by which entry, who and when."""
        what = (
            f"event {self.message_id}"
            if self.message_id is not None
            else f"{self.events} event(s) in ({self.after}, {self.upto}]"
        )
        return (
            f"part {self.part}: {what} skipped by `{self.entry.action}` (ledger #{self.entry.id}, "
            f"{self.entry.who}, {self.entry.recorded_at:%Y-%m-%d %H:%M:%S %Z})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "ledger_id": self.entry.id,
            "action": self.entry.action.value,
            "recorded_at": self.entry.recorded_at.isoformat(),
            "who": self.entry.who,
            "part": self.part,
            "events": self.events,
            "message_id": None if self.message_id is None else str(self.message_id),
            "after": None if self.after is None else str(self.after),
            "upto": None if self.upto is None else str(self.upto),
        }


@dataclass(frozen=True)
class PartMove:
    """What a reset does to one part: its checkpoint from ``before`` to ``after``, and
    the part's events in between that the subscriber's filters match (those skipped by
    the operator already left out): skipped when it moves forward, published again when
    it moves back."""

    part: int
    before: Position
    after: Position
    events: int

    @property
    def skips(self) -> bool:
        return self.after > self.before

    def describe(self) -> str:
        if self.after == self.before:
            return f"part {self.part}: stays at {self.before}"
        if self.skips:
            return (
                f"part {self.part}: SKIPS {self.events} event(s), ({self.before}, {self.after}]"
                " (never published)"
            )
        return (
            f"part {self.part}: publishes {self.events} event(s) AGAIN, "
            f"({self.after}, {self.before}]"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "from": str(self.before),
            "to": str(self.after),
            "skipped" if self.skips else "republished": self.events,
        }


class SkipTarget(NamedTuple):
    """What ``subscribers skip`` checks of one event asked for (``skip_targets``)."""

    message_id: UUID
    key: Position | None  # None: no such event in the outbox
    aggregate_type: str | None
    event_type: str | None
    part: int | None
    checkpoint: Position | None  # its part's
    matches: bool | None  # whether the subscriber's filters take it
    skipped_by: int | None  # the ledger entry that skipped it already
    halted_on_it: bool | None  # its part is halted on it

    @property
    def pending(self) -> bool:
        """Not published yet by its part: after the checkpoint."""
        return self.key is not None and self.checkpoint is not None and self.key > self.checkpoint

    def refusal(self, name: str) -> str | None:
        """Why subscriber ``name`` cannot skip this event; None when it can."""
        event = f"event {self.message_id}"
        if self.key is None:
            return f"{event} is not in the outbox (never written, or pruned)"
        if not self.matches:
            return (
                f"{event} ({self.aggregate_type}/{self.event_type}) is not one subscriber "
                f"{name!r} publishes: its filters leave it out"
            )
        if self.skipped_by is not None:
            return f"{event} is skipped already (ledger #{self.skipped_by})"
        if not self.pending:
            return (
                f"{event} at {self.key} is published already: part {self.part}'s checkpoint "
                f"is {self.checkpoint} (skip stops only events not yet published)"
            )
        return None


def reset_target(name: str, to: StartFrom | Position, horizon: Callable[[], int]) -> Position:
    """Where a reset of ``name`` to ``to`` puts the checkpoints: 'beginning' before
    every row, 'now' after every transaction decided (``horizon``, asked only then); a
    position beyond the horizon is refused (every store's ``reset_target``)."""
    if to is StartFrom.BEGINNING:
        return Position(0, 0)
    at = horizon()
    if to is StartFrom.NOW:
        return Position(at, 0)
    assert isinstance(to, Position)
    if to > Position(at, 0):
        raise SubscriberError(
            f"cannot reset {name!r} to {to}: it is beyond what the database has "
            f"decided (the horizon is {at}:0; transactions from {at} on are "
            "still running or yet to begin), so events written from now on would sort "
            f"before it and never be published. Reset to a point at or below "
            f"{at}:0, or to 'now'"
        )
    return to


def reset_entry(record: Intervention, moves: Sequence[PartMove]) -> Intervention:
    """``record`` of a reset as the ledger keeps it: with each part's move and the events
    skipped or published again, all parts together."""
    params = {**record.params, "parts": [m.as_dict() for m in moves]}
    return dataclasses.replace(record, params=params, events=sum(m.events for m in moves))


def check_skippable(name: str, targets: Sequence[SkipTarget]) -> None:
    """Refuse a skip (``SubscriberError``, with every reason) unless each event may be
    skipped."""
    refusals = [r for t in targets if (r := t.refusal(name)) is not None]
    if refusals:
        raise SubscriberError("; ".join(refusals))


def resumed_parts(targets: Sequence[SkipTarget]) -> list[int]:
    """The parts a skip of ``targets`` resumes: those halted on one of them."""
    return sorted({t.part for t in targets if t.halted_on_it and t.part is not None})
