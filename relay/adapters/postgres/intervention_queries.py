"""The outbox store's operator interventions: pause, reset, remove and skip, each on the
ledger of interventions in the same transaction (migration 0019), and that ledger read
(a piece of :class:`~relay.adapters.postgres.store.OutboxStore`)."""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from relay.adapters.postgres import part_index
from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.store_base import StoreBase, sorted_or_none
from relay.core.interventions import (
    Action,
    Intervention,
    OperatorSkip,
    PartMove,
    Recorded,
    SkipTarget,
    check_skippable,
    reset_entry,
    reset_target,
    resumed_parts,
)
from relay.core.model import Position
from relay.core.ports import SubscriberState
from relay.core.subscribers import StartFrom
from relay.errors import NotMigratedError, SubscriberError, UndefinedTableError


class InterventionQueries(StoreBase, ABC):
    """What the operators' commands change of a subscriber, and their ledger."""

    # -- what the interventions read of the store's other queries (OutboxStore's) -------

    @abstractmethod
    def get(self, name: str) -> SubscriberState: ...

    @abstractmethod
    def list(self, name: str | None = None) -> builtins.list[SubscriberState]: ...

    @abstractmethod
    def horizon(self) -> int: ...

    # -- pause, reset and remove -------------------------------------------------------

    def set_paused(self, name: str, paused: bool, record: Intervention | None = None) -> None:
        """Pause or resume (which clears a halt) every part; with ``record``, on the
        ledger in the same transaction."""
        with wrap_errors(), self.conn.transaction():
            rows = self.conn.execute(
                self._q["set_paused"], {"name": name, "paused": paused}
            ).fetchall()
            if not rows:
                raise SubscriberError(f"no subscriber named {name!r}")
            if record is not None:
                self._record(record)

    def reset(
        self, name: str, to: StartFrom | Position, record: Intervention | None = None
    ) -> builtins.list[PartMove]:
        """Move every part's checkpoint to the beginning, to now, or to just after a
        position; returns what it did to each part. With ``record``, on the ledger in
        the same transaction, with the moves and the events skipped or published again
        (and every range skipped, which status and verify report from then on).

        A position beyond the horizon is refused: transactions still running or not yet
        begun write rows that sort before it, and they would never be published (issue
        #28). The horizon only grows, so checking it first leaves no race.
        """
        with wrap_errors(), self.conn.transaction():
            # The parts are locked first: a relay's advance waits, so the moves counted
            # are the moves made.
            locked = self.conn.execute(self._q["lock_parts"], {"name": name}).fetchall()
            if not locked:
                raise SubscriberError(f"no subscriber named {name!r}")
            target = self.reset_target(name, to)
            state = self.get(name)
            checkpoints = {part: Position(tx, pos) for part, tx, pos, _, _ in locked}
            moves = self._moves(state, checkpoints, target)
            params = {"name": name, "to": "position", **_key_params(target)}
            self.conn.execute(self._q["reset_checkpoint"], params)
            if record is not None:
                self._record_reset(record, state, moves)
        return moves

    def reset_target(self, name: str, to: StartFrom | Position) -> Position:
        """Where a reset of ``name`` to ``to`` puts the checkpoints: 'beginning' before
        every row, 'now' after every transaction decided (the horizon); a position
        beyond the horizon is refused."""
        return reset_target(name, to, self.horizon)

    def moves(self, state: SubscriberState, target: Position) -> builtins.list[PartMove]:
        """What a reset of ``state``'s parts to ``target`` would do to each: the events
        of the part between its checkpoint and the target that the subscriber's filters
        match, but those the operator skipped already (skipped forward, or published
        again backward)."""
        with wrap_errors():
            return self._moves(state, {p.part: p.checkpoint for p in state.parts}, target)

    def _moves(
        self, state: SubscriberState, checkpoints: dict[int, Position], target: Position
    ) -> builtins.list[PartMove]:
        ranges = {part: (min(at, target), max(at, target)) for part, at in checkpoints.items()}
        subscriber = state.subscriber
        params = {
            "parts": subscriber.parts,
            "part": list(ranges),
            **_keys_params([r[0] for r in ranges.values()], "after_"),
            **_keys_params([r[1] for r in ranges.values()], "upto_"),
            **_key_params(min(r[0] for r in ranges.values()), "low_"),
            **_key_params(max(r[1] for r in ranges.values()), "high_"),
            "aggregate_types": sorted_or_none(subscriber.aggregate_types),
            "event_types": sorted_or_none(subscriber.event_types),
            "subscriber_id": state.subscriber_id,
        }
        counts = dict(self.conn.execute(self._q["count_moved_events"], params).fetchall())
        return [
            PartMove(part, at, target, counts.get(part, 0))
            for part, at in sorted(checkpoints.items())
        ]

    def _record_reset(
        self, record: Intervention, state: SubscriberState, moves: builtins.list[PartMove]
    ) -> None:
        entry = self._record(reset_entry(record, moves))
        for move in moves:
            if move.skips and move.events:
                range_params = {
                    "intervention": entry,
                    "subscriber_id": state.subscriber_id,
                    "part": move.part,
                    **_key_params(move.before, "after_"),
                    **_key_params(move.after, "upto_"),
                    "events": move.events,
                }
                self.conn.execute(self._q["record_skipped_range"], range_params)

    def remove(self, name: str, record: Intervention | None = None) -> None:
        """Delete the subscriber and its checkpoints; with ``record``, on the ledger in
        the same transaction (the ledger keeps it: it has no foreign key)."""
        with wrap_errors(), self.conn.transaction():
            rows = self.conn.execute(self._q["delete_subscriber"], {"name": name}).fetchall()
            if not rows:
                raise SubscriberError(f"no subscriber named {name!r}")
            if record is not None:
                self._record(record)
        in_use = [s.subscriber.parts for s in self.list()]
        part_index.drop_unused(self.conn, self.schema, rows[0][1], in_use)

    # -- the operators' ledger and skips (migration 0019) --------------------------------

    def record(self, intervention: Intervention) -> int:
        """Put ``intervention`` on the ledger; returns its entry's id. (An action that
        changes state records with its change instead, in one transaction.)"""
        with wrap_errors():
            return self._record(intervention)

    def _record(self, intervention: Intervention) -> int:
        params = {
            "subscriber": intervention.subscriber,
            "subscriber_id": intervention.subscriber_id,
            "action": intervention.action.value,
            "os_user": intervention.actor.os_user,
            "host": intervention.actor.host,
            "params": Jsonb(intervention.params),
            "events": intervention.events,
        }
        try:
            row = self.conn.execute(self._q["record_intervention"], params).fetchone()
        except psycopg.errors.UndefinedTable as exc:
            # Every intervention is on the record, or it is not made: its transaction
            # rolls back with this error.
            raise NotMigratedError(
                "the ledger of interventions is missing (migration 0019): run `outbox-relay "
                "migrate`; nothing was changed"
            ) from exc
        assert row is not None
        return int(row[0])

    def skip_targets(self, name: str, message_ids: Sequence[UUID]) -> builtins.list[SkipTarget]:
        """What ``subscribers skip`` checks of each event (in the order asked)."""
        with wrap_errors():
            return self._skip_targets(name, message_ids)

    def _skip_targets(self, name: str, message_ids: Sequence[UUID]) -> builtins.list[SkipTarget]:
        query = self._q["skip_targets"]
        rows = self.conn.execute(query, {"name": name, "ids": list(message_ids)}).fetchall()
        if not rows:
            raise SubscriberError(f"no subscriber named {name!r}")
        found = {
            row[0]: SkipTarget(
                row[0],
                None if row[1] is None else Position(row[1], row[2]),
                row[3],
                row[4],
                row[5],
                None if row[6] is None else Position(row[6], row[7]),
                *row[8:],
            )
            for row in rows
        }
        return [found[m] for m in message_ids]

    def skip(
        self, name: str, message_ids: Sequence[UUID], record: Intervention
    ) -> builtins.list[int]:
        """Skip these events of ``name``: each part drops its own when it meets them,
        and a part halted on one of them resumes; on the ledger, in one transaction.
        Refused (``SubscriberError``, nothing changed) unless every event is in the
        outbox, taken by the subscriber's filters, not published by its part yet, and
        not skipped already. Returns the parts resumed."""
        with wrap_errors(), self.conn.transaction():
            # Locked first: no relay advances past them between the check and the skip.
            self.conn.execute(self._q["lock_parts"], {"name": name})
            targets = self._skip_targets(name, message_ids)
            check_skippable(name, targets)
            entry = self._record(record)
            subscriber_id = self.get(name).subscriber_id
            by_part: dict[int, list[UUID]] = {}
            for t in targets:
                assert t.part is not None
                by_part.setdefault(t.part, []).append(t.message_id)
                skipped = {
                    "intervention": entry,
                    "subscriber_id": subscriber_id,
                    "part": t.part,
                    "message_id": t.message_id,
                }
                self.conn.execute(self._q["record_skipped_event"], skipped)
            for part, ids in by_part.items():
                self.conn.execute(self._q["skip_on_part"], {"name": name, "part": part, "ids": ids})
        return resumed_parts(targets)

    def ledger(self, name: str) -> builtins.list[Recorded]:
        """The interventions recorded for subscribers named ``name``, oldest first."""
        with wrap_errors():
            rows = self.conn.execute(self._q["ledger"], {"name": name}).fetchall()
        return [_recorded(row) for row in rows]

    def operator_skips(self, subscriber_id: UUID) -> builtins.list[OperatorSkip]:
        """What the operator skipped of the subscriber ``subscriber_id``, per ledger
        entry and part (none on a schema before migration 0019)."""
        try:
            with wrap_errors():
                rows = self.conn.execute(
                    self._q["operator_skips"], {"subscriber_id": subscriber_id}
                ).fetchall()
        except UndefinedTableError:
            return []
        return [
            OperatorSkip(
                _recorded(row[:10]),
                row[10],
                row[11],
                row[12],
                None if row[13] is None else Position(row[13], row[14]),
                None if row[15] is None else Position(row[15], row[16]),
            )
            for row in rows
        ]


def _key_params(key: Position, prefix: str = "") -> dict[str, int]:
    return {f"{prefix}transaction_id": key.transaction_id, f"{prefix}position": key.position}


def _keys_params(keys: builtins.list[Position], prefix: str) -> dict[str, builtins.list[int]]:
    return {
        f"{prefix}transaction_id": [k.transaction_id for k in keys],
        f"{prefix}position": [k.position for k in keys],
    }


def _recorded(row: Sequence[Any]) -> Recorded:
    return Recorded(
        row[0], row[1], row[2], Action(row[3]), row[4], row[5], row[6], row[7], row[8], row[9]
    )
