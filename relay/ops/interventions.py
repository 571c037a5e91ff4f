"""Operators' interventions: the commands that change what a subscriber publishes, each
on the ledger (migration 0019; docs/design.md §1, "Resets", and §7, "Skipping one
event").

Each command that skips or republishes events (``subscribers reset``, ``subscribers
skip``, ``subscribers replay`` (relay/ops/replay.py), ``dead-letters redrive``) first
computes a :class:`Preview` (how many events, which range or which ids) and hands it to
``confirm``, the command line's gate (``--dry-run``, ``--yes``, or a question on a
terminal); only if it says yes is anything changed, and then recorded with the change,
in one transaction. What the change did is counted again there, under a lock on the
subscriber's parts: a relay publishing meanwhile may have changed the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from relay.core.interventions import Action, Actor, Intervention, OperatorSkip, PartMove, Recorded
from relay.core.model import Position
from relay.core.ports import InterventionStore, PendingDeadLetters
from relay.core.subscribers import StartFrom, Subscriber
from relay.errors import SubscriberError

# Ids one `skip` takes at most, and ids a preview names at most.
MAX_SKIPPED = 1000
_NAMED = 20


@dataclass(frozen=True)
class Preview:
    """What a command would skip or republish, before it does anything."""

    action: Action
    subscriber: str
    events: int
    summary: str  # one line: what, how many events
    lines: tuple[str, ...] = ()  # which range or which ids


# The command line's gate: True to go ahead; False (a dry run) to change nothing.
Confirm = Callable[[Preview], bool]


def reset(
    store: InterventionStore,
    name: str,
    to: StartFrom | Position,
    actor: Actor,
    confirm: Confirm,
) -> list[PartMove] | None:
    """``subscribers reset``: preview, confirm, then move every part to ``to`` and put
    it on the ledger; returns each part's move, None when not confirmed."""
    state = store.get(name)
    # 'now' is pinned to the horizon as previewed, so the reset confirmed is the reset
    # made (events written meanwhile wait, and are published).
    target = store.reset_target(name, to)
    moves = store.moves(state, target)
    shown = to.value if isinstance(to, StartFrom) else str(to)
    preview = Preview(
        Action.RESET,
        name,
        sum(m.events for m in moves),
        f"reset of subscriber {name!r} to {shown} ({target}): {_moves(moves)}",
        tuple(m.describe() for m in moves),
    )
    if not confirm(preview):
        return None
    record = Intervention(
        Action.RESET, name, state.subscriber_id, actor, {"to": shown, "target": str(target)}
    )
    return store.reset(name, target, record)


def _moves(moves: Sequence[PartMove]) -> str:
    skipped = sum(m.events for m in moves if m.skips)
    again = sum(m.events for m in moves if not m.skips)
    return f"{skipped} event(s) SKIPPED (never published), {again} published AGAIN"


@dataclass(frozen=True)
class SkipDone:
    """What ``subscribers skip`` did: the parts it resumed (halted on one of the
    events), and the parts still halted, with why."""

    events: int
    resumed: list[int] = field(default_factory=list)
    still_halted: dict[int, str] = field(default_factory=dict)


def skip(
    store: InterventionStore,
    name: str,
    message_ids: Sequence[UUID],
    actor: Actor,
    confirm: Confirm,
) -> SkipDone | None:
    """``subscribers skip``: check each event (in the outbox, taken by the subscriber,
    not published yet, not skipped already: a ``SubscriberError`` names every refusal),
    preview, confirm, then skip exactly those events and put it on the ledger. A part
    halted on one of them resumes. None when not confirmed."""
    ids = list(dict.fromkeys(message_ids))  # once each, in the order given
    if not ids:
        raise SubscriberError("name the events to skip: --event MESSAGE_ID (repeatable)")
    if len(ids) > MAX_SKIPPED:
        raise SubscriberError(f"at most {MAX_SKIPPED} events per skip; got {len(ids)}")
    targets = store.skip_targets(name, ids)
    refusals = [r for t in targets if (r := t.refusal(name)) is not None]
    if refusals:
        raise SubscriberError(f"nothing skipped: {'; '.join(refusals)}")
    lines = tuple(
        f"event {t.message_id} at {t.key} ({t.aggregate_type}/{t.event_type}), part {t.part}"
        + ("; its part is halted on it: the skip resumes it" if t.halted_on_it else "")
        for t in targets
    )
    preview = Preview(
        Action.SKIP,
        name,
        len(targets),
        f"skip of {len(targets)} event(s) of subscriber {name!r}: never published by it; "
        "every other event is",
        lines,
    )
    if not confirm(preview):
        return None
    params = {
        "events": [
            {"message_id": str(t.message_id), "key": str(t.key), "part": t.part} for t in targets
        ]
    }
    state = store.get(name)
    record = Intervention(Action.SKIP, name, state.subscriber_id, actor, params, len(targets))
    resumed = store.skip(name, ids, record)
    halted = {p.part: p.halted_error for p in store.get(name).parts if p.halted_error is not None}
    return SkipDone(len(targets), resumed, halted)


def set_paused(store: InterventionStore, name: str, paused: bool, actor: Actor) -> dict[int, str]:
    """``subscribers pause`` / ``resume``, on the ledger; returns the halts a resume
    cleared (part → error), which the entry names too."""
    state = store.get(name)
    cleared = {} if paused else {p.part: p.halted_error for p in state.parts if p.halted_error}
    params: dict[str, Any] = {"cleared_halts": {str(k): v for k, v in cleared.items()}}
    action = Action.PAUSE if paused else Action.RESUME
    store.set_paused(
        name,
        paused,
        Intervention(action, name, state.subscriber_id, actor, params if cleared else {}),
    )
    return cleared


def remove(store: InterventionStore, name: str, actor: Actor) -> None:
    """``subscribers remove``, on the ledger with the definition and checkpoints it had
    (the ledger outlives the subscriber)."""
    state = store.get(name)
    params = {
        "definition": state.subscriber.as_dict(),
        "checkpoints": {str(p.part): str(p.checkpoint) for p in state.parts},
    }
    store.remove(name, Intervention(Action.REMOVE, name, state.subscriber_id, actor, params))


def add(
    store: InterventionStore,
    subscriber: Subscriber,
    start: StartFrom,
    actor: Actor,
    *,
    replace: bool,
) -> bool:
    """``subscribers add [--replace]``, on the ledger with the definition before and
    after; True when it created the subscriber."""
    name = subscriber.name
    before = next((s.subscriber for s in store.list(name)), None)
    with store.transaction():  # the definition and its entry, together
        created = store.add(subscriber, start, replace=replace)
        state = store.get(name)
        params: dict[str, Any] = {"after": state.subscriber.as_dict()}
        if created:
            params["from"] = start.value
        elif before is not None:
            params["before"] = before.as_dict()
        action = Action.ADD if created else Action.REPLACE
        store.record(Intervention(action, name, state.subscriber_id, actor, params))
    return created


def redrive_preview(name: str, message_ids: Sequence[UUID]) -> Preview:
    """What ``dead-letters redrive`` would publish: the pending dead letters."""
    return Preview(
        Action.REDRIVE,
        name,
        len(message_ids),
        f"redrive of subscriber {name!r}: publishes {len(message_ids)} dead-lettered "
        "event(s) to its topics (those still poison stay dead-lettered)",
        _named(message_ids),
    )


def record_redrive(
    store: InterventionStore, name: str, subscriber_id: UUID, actor: Actor, report: dict[str, Any]
) -> int:
    """Put a redrive that ran on the ledger, with its report (``RedriveReport.as_dict``)."""
    params = {k: v for k, v in report.items() if k != "subscriber"}
    redriven = int(report.get("redriven", 0))
    return store.record(Intervention(Action.REDRIVE, name, subscriber_id, actor, params, redriven))


def prune_pending(
    store: PendingDeadLetters, name: str, older_than_s: float, actor: Actor, confirm: Confirm
) -> int | None:
    """``dead-letters prune --pending-older-than``: preview the dead letters not yet
    redriven that it would delete (they can never be redriven afterwards), confirm, then
    delete exactly those and put it on the ledger with their ids. None when not
    confirmed."""
    ids = store.pending_before(name, older_than_s)
    preview = Preview(
        Action.PRUNE,
        name,
        len(ids),
        f"prune of subscriber {name!r}: deletes {len(ids)} dead letter(s) not redriven, "
        f"decided more than {older_than_s:g} s ago: they can NEVER be redriven (their "
        "records stay on the dead-letter topic)",
        _named(ids),
    )
    if not confirm(preview):
        return None
    state = store.subscriber(name)
    params = {"pending_older_than": older_than_s}  # the ids: in outbox_skipped
    return store.prune_pending(
        name, ids, Intervention(Action.PRUNE, name, state.subscriber_id, actor, params)
    )


def _named(message_ids: Sequence[UUID]) -> tuple[str, ...]:
    """The first ids of a preview, and how many more."""
    shown = [str(m) for m in message_ids[:_NAMED]]
    more = len(message_ids) - len(shown)
    return (*shown, *([f"... and {more} more"] if more else []))


def history(store: InterventionStore, name: str) -> list[Recorded]:
    """``subscribers history``: the ledger of every subscriber named ``name`` (removed
    ones too), oldest first."""
    entries = store.ledger(name)
    if not entries and not store.list(name):
        raise SubscriberError(f"no subscriber named {name!r}, and none on the ledger")
    return entries


def operator_skips(
    store: InterventionStore, subscriber_ids: Sequence[UUID]
) -> dict[UUID, list[OperatorSkip]]:
    """What the operator skipped of each subscriber, per ledger entry and part."""
    return {s: store.operator_skips(s) for s in subscriber_ids}
