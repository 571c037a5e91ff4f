"""The Postgres side of the relay: committed events, subscribers, parts and sessions.

:class:`OutboxStore` is the Postgres adapter of the daemon's store port
(``relay.core.ports.DaemonStore``, which extends the part worker's ``PartStore``), and more:
the operators' commands (status, lag, reset, remove) use it directly."""

from __future__ import annotations

import builtins
import dataclasses
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb, set_json_loads

from relay.adapters.postgres import fetch_plan, part_index
from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import queries_for
from relay.core import ports
from relay.core.formats import format_of
from relay.core.interventions import Action, Intervention, OperatorSkip, PartMove, Recorded
from relay.core.key_space import KeySpace, KeySpaceAction, KeySpaceCheck
from relay.core.model import PartId, Position
from relay.core.ports import (
    DeadLetter,
    DeadLetterDecision,
    ExpiredSession,
    Fetched,
    HorizonHolder,
    LagSample,
    PartSkips,
    PartState,
    Selection,
)
from relay.core.subscribers import StartFrom, SubjectStrategy, Subscriber, collision
from relay.errors import (
    CheckpointConflict,
    ClaimLost,
    DatabaseError,
    NotMigratedError,
    SubscriberError,
    UndefinedFunctionError,
    UndefinedTableError,
)

# Moved to the ports (the daemon's store port returns it); still importable from here.
SubscriberState = ports.SubscriberState


_UNDEFINED_COLUMN = "42703"
# Schemas found without migration 0019 (a rolling deploy), until when: their parts are
# read without a skip list meanwhile, not with a failed query every poll; then the
# query is tried again (`migrate` may have run).
_WITHOUT_SKIPS: dict[tuple[str, int, str, str], float] = {}
_RECHECK_SKIPS_S = 60.0


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


class PartWait(NamedTuple):
    """What a part owned by a live relay waits for, as its worker recorded it (issue #48;
    relay/engine/waiting.py)."""

    waits_on: str  # what RelayError.waits_on names: topic, postgres_privilege, ...
    error: str  # why, with what ends the wait
    since: datetime


class OutboxStore:
    """Queries over one outbox schema, on one connection (autocommit)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        self.conn = conn
        self.schema = schema
        self._q = queries_for(schema)

    def close(self) -> None:
        self.conn.close()

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by :meth:`close`, or broken)."""
        return self.conn.closed

    # -- the relay's hot path --------------------------------------------------------

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        plan = fetch_plan.plan(self.schema, selection)
        # Binary transfer: integers, uuids and timestamps load without text parsing.
        with wrap_errors(), self.conn.cursor(binary=True) as cur:
            set_json_loads(fetch_plan.load_row_json, cur)
            rows = cur.execute(
                plan.query, plan.params_after(after), prepare=plan.prepare
            ).fetchall()
        return plan.decode(rows, selection)

    def advance(
        self,
        state: PartState,
        to: Position,
        owner: UUID,
        dead_letters: Sequence[DeadLetter] = (),
        *,
        durable: bool = True,
    ) -> int:
        """Compare-and-set ``state``'s checkpoint to ``to`` and record ``dead_letters`` in
        one transaction; returns the new version. ``durable=False`` commits it with
        ``synchronous_commit = off``."""
        params = {
            "name": state.name,
            "part": state.part,
            "transaction_id": to.transaction_id,
            "position": to.position,
            "version": state.version,
            "owner": owner,
            "synchronous_commit": None if durable else "off",
        }
        conflict = CheckpointConflict(
            f"checkpoint of {state.name}/{state.part} changed underneath this relay"
        )
        if not dead_letters:  # the hot path: one statement
            with wrap_errors():
                row = self.conn.execute(self._q["advance_checkpoint"], params).fetchone()
            if row is None:
                raise conflict
            return int(row[0])
        # One statement for the batch's dead letters, however many (a flood of poison
        # rows dead-letters thousands a transaction).
        letters = {
            "name": state.name,
            "part": state.part,
            "transaction_ids": [letter.key.transaction_id for letter in dead_letters],
            "positions": [letter.key.position for letter in dead_letters],
            "message_ids": [letter.message_id for letter in dead_letters],
            "topics": [letter.decision.topic for letter in dead_letters],
            "errors": [letter.decision.error for letter in dead_letters],
        }
        with wrap_errors(), self.conn.transaction():
            row = self.conn.execute(self._q["advance_checkpoint"], params).fetchone()
            if row is None:
                raise conflict  # rolls the transaction back: nothing recorded
            self.conn.execute(self._q["record_dead_letters"], letters)
        return int(row[0])

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        """Dead-letter decisions already recorded for events in ``(after, upto]``."""
        params = {
            "name": name,
            "from_tx": after.transaction_id,
            "from_pos": after.position,
            "to_tx": upto.transaction_id,
            "to_pos": upto.position,
        }
        with wrap_errors():
            rows = self.conn.execute(self._q["dead_letters_between"], params).fetchall()
        return {row[0]: DeadLetterDecision(row[1], row[2]) for row in rows}

    def halt(
        self, state: PartState, owner: UUID, error: str, message_id: UUID | None = None
    ) -> None:
        """Record a 'halt' poison decision, on the event ``message_id`` if it names one:
        the part stays halted until resumed (or that event skipped)."""
        params = {
            "name": state.name,
            "part": state.part,
            "owner": owner,
            "error": error,
            "message_id": message_id,
        }
        try:
            with wrap_errors():
                row = self.conn.execute(self._q["halt_part"], params).fetchone()
        except DatabaseError as exc:
            if exc.sqlstate != _UNDEFINED_COLUMN:
                raise
            # A schema before migration 0019 (a rolling deploy): no halted_message_id.
            with wrap_errors():
                row = self.conn.execute(self._q["halt_part_without_message_id"], params).fetchone()
        if row is None:
            raise ClaimLost(f"{state.name}/{state.part} is no longer claimed by this relay")

    def record_wait(
        self, part: PartId, owner: UUID, waits_on: str | None, error: str | None
    ) -> None:
        """Record what the part waits for (None: nothing), for ``status``; a schema
        before migration 0020 raises (the caller records nothing then)."""
        params = {
            "name": part.subscriber,
            "part": part.part,
            "owner": owner,
            "waits_on": waits_on,
            "error": error,
        }
        with wrap_errors():
            self.conn.execute(self._q["record_wait"], params)

    def part_waits(self) -> dict[PartId, PartWait]:
        """The parts live relays own that wait, with what for and since when (none on a
        schema before migration 0020)."""
        with wrap_errors():
            rows = self.conn.execute(self._q["part_waits"]).fetchall()
        return {PartId(name, part): PartWait(*wait) for name, part, *wait in rows}

    def lag_sample(self, state: PartState, scan: int) -> LagSample:
        """The part's rows after its checkpoint, decided or not, scanned up to ``scan``."""
        params = {
            **_part_params(state),
            "scan": scan,
            "aggregate_types": _sorted(state.subscriber.aggregate_types),
            "event_types": _sorted(state.subscriber.event_types),
        }
        try:
            with wrap_errors():
                row = self.conn.execute(self._q["part_lag"], params).fetchone()
        except DatabaseError as exc:
            if exc.sqlstate != _UNDEFINED_COLUMN:
                raise
            # A schema before migration 0018 (a rolling deploy): no recorded_at yet.
            with wrap_errors():
                row = self.conn.execute(self._q["part_lag_by_occurred_at"], params).fetchone()
        assert row is not None
        return LagSample(*row)

    def horizon(self) -> int:
        """The oldest transaction id not yet decided: every row below it is final."""
        with wrap_errors():
            row = self.conn.execute(self._q["horizon"]).fetchone()
        assert row is not None
        return int(row[0])

    def part_skips(self, name: str, scan: int | None) -> list[PartSkips]:
        """Each part's events the operator skipped (every reset forward and every skip,
        from the ledger), and whether its checkpoint lies beyond the horizon, with the
        events such a checkpoint skipped (``scan``: rows scanned at most, None: all)."""
        params = {"name": name, "scan": scan}
        try:
            with wrap_errors():
                rows = self.conn.execute(self._q["part_skips"], params).fetchall()
        except UndefinedTableError:
            # A schema before migration 0019 (a rolling deploy): the last reset only.
            try:
                with wrap_errors():
                    query = self._q["part_skips_before_ledger"]
                    rows = self.conn.execute(query, params).fetchall()
            except DatabaseError as exc:
                if exc.sqlstate != _UNDEFINED_COLUMN:
                    raise
                return []  # a schema before migration 0009: no reset recorded what it skipped
        return [PartSkips(*row) for row in rows]

    def horizon_holders(self) -> list[HorizonHolder]:
        """Backends holding the publication horizon back, oldest first."""
        with wrap_errors():
            rows = (
                self.conn.cursor(row_factory=dict_row)
                .execute(self._q["horizon_holders"])
                .fetchall()
            )
        return [HorizonHolder(**row) for row in rows]

    def sees_all_backends(self) -> bool:
        """Whether :meth:`horizon_holders` can see every role's sessions, or only its own
        role's (no ``pg_read_all_stats``: see ``outbox-relay grant --read-all-stats``)."""
        with wrap_errors():
            row = self.conn.execute(self._q["sees_all_backends"]).fetchone()
        return bool(row and row[0])

    def prune(self, older_than_s: float, batch: int = 10_000) -> Iterator[int]:
        """Delete published rows older than ``older_than_s``, ``batch`` rows per
        transaction; yields each batch's count. Never an unpublished row.

        Through ``outbox_prune()`` (migration 0008, SECURITY DEFINER), so the relay role
        needs no DELETE on the outbox; on an older schema (a rolling deploy), directly."""
        params = {"older_than": older_than_s, "limit": batch}
        while True:
            try:
                with wrap_errors():
                    row = self.conn.execute(self._q["prune"], params).fetchone()
            except UndefinedFunctionError:
                yield from self._prune_directly(older_than_s, batch)
                return
            deleted = int(row[0]) if row else 0
            if deleted <= 0:
                return
            yield deleted

    def prune_dead_letters(
        self,
        subscriber: str | None = None,
        *,
        pending_older_than_s: float | None = None,
        batch: int = 10_000,
    ) -> Iterator[int]:
        """Delete dead letters (``subscriber``'s, or every subscriber's) whose retention
        is over, ``batch`` per transaction; yields each batch's count. Redriven ones
        whose event the outbox's retention pruned; with ``pending_older_than_s`` (the
        operator's word: they cannot be redriven afterwards), instead those not redriven
        decided longer ago than that."""
        params = {"name": subscriber, "older_than": pending_older_than_s, "limit": batch}
        pending = pending_older_than_s is not None
        query = self._q["prune_pending_dead_letters" if pending else "prune_redriven_dead_letters"]
        while True:
            with wrap_errors():
                deleted = self.conn.execute(query, params).rowcount
            if deleted <= 0:
                return
            yield deleted

    def _prune_directly(self, older_than_s: float, batch: int) -> Iterator[int]:
        with wrap_errors():
            row = self.conn.execute(self._q["prune_bound"]).fetchone()
        if row is None or row[0] is None:
            return
        params = {
            "transaction_id": row[0],
            "position": row[1],
            "older_than": older_than_s,
            "limit": batch,
        }
        while True:
            with wrap_errors():
                deleted = self.conn.execute(self._q["prune_batch"], params).rowcount
            if deleted <= 0:
                return
            yield deleted

    # -- the key space (restore safety) -----------------------------------------------

    def check_key_space(self) -> KeySpaceCheck | None:
        """Check (and repair) that the stored keys fit this cluster's transaction ids;
        None on a schema from before migration 0004 (a rolling deploy)."""
        try:
            with wrap_errors():
                row = self.conn.execute(self._q["check_key_space"]).fetchone()
        except UndefinedFunctionError:
            return None
        assert row is not None
        return KeySpaceCheck(KeySpaceAction(row[0]), row[1], row[2], row[3])

    def key_space(self) -> KeySpace:
        with wrap_errors():
            row = self.conn.execute(self._q["key_space"]).fetchone()
        assert row is not None, "outbox_key_space has its one row from migration 0004"
        return KeySpace(row[0], row[1], row[2])

    def key_of(self, message_id: UUID) -> Position | None:
        with wrap_errors():
            row = self.conn.execute(
                self._q["key_of_message"], {"message_id": message_id}
            ).fetchone()
        return Position(*row) if row is not None else None

    def messages_at(self, keys: Sequence[Position]) -> dict[Position, UUID]:
        """The message id of the event at each of ``keys`` the outbox holds."""
        params = {
            "transaction_ids": [key.transaction_id for key in keys],
            "positions": [key.position for key in keys],
        }
        with wrap_errors():
            rows = self.conn.execute(self._q["messages_at_keys"], params).fetchall()
        return {Position(tx, pos): message_id for tx, pos, message_id in rows}

    def translate(self, key_space: UUID, key: Position) -> Position:
        """A key of ``key_space`` as a key of the space rebased from it."""
        params = {"key_space": key_space, **key._asdict()}
        with wrap_errors():
            row = self.conn.execute(self._q["translate_key"], params).fetchone()
        assert row is not None
        return Position(*row)

    # -- sessions and claims (design §4) ------------------------------------------------

    def open_session(self, hostname: str, pid: int, timeout: float) -> UUID:
        params = {"hostname": hostname, "pid": pid, "timeout": timeout}
        with wrap_errors():
            row = self.conn.execute(self._q["open_session"], params).fetchone()
        assert row is not None
        return UUID(str(row[0]))

    def heartbeat(self, session: UUID, timeout: float) -> bool:
        """Extend ``session``; False when it is gone (expired and deleted by a peer)."""
        with wrap_errors():
            row = self.conn.execute(
                self._q["heartbeat"], {"id": session, "timeout": timeout}
            ).fetchone()
        return row is not None

    def expire_sessions(self) -> list[ExpiredSession]:
        """Delete expired sessions (their claims become free); returns them."""
        with wrap_errors():
            rows = self.conn.execute(self._q["expire_sessions"]).fetchall()
        return [ExpiredSession(UUID(str(r[0])), r[1], r[2]) for r in rows]

    def next_expiry(self) -> float | None:
        with wrap_errors():
            row = self.conn.execute(self._q["next_expiry"]).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def close_session(self, session: UUID) -> None:
        with wrap_errors():
            self.conn.execute(self._q["close_session"], {"id": session})

    def live_sessions(self) -> list[UUID]:
        with wrap_errors():
            rows = self.conn.execute(self._q["live_sessions"]).fetchall()
        return [UUID(str(r[0])) for r in rows]

    def list_sessions(self) -> list[dict[str, Any]]:
        with wrap_errors():
            return (
                self.conn.cursor(row_factory=dict_row).execute(self._q["list_sessions"]).fetchall()
            )

    def claim(self, name: str, part: int, owner: UUID) -> bool:
        """Claim the free part for ``owner``; False when someone holds it."""
        return self._set_owner("claim_part", name, part, owner)

    def release(self, name: str, part: int, owner: UUID) -> bool:
        """Free the part; False when ``owner`` does not hold it."""
        return self._set_owner("release_part", name, part, owner)

    def _set_owner(self, query: str, name: str, part: int, owner: UUID) -> bool:
        """Run ``query`` (claim_part, release_part); whether it changed the owner."""
        params = {"name": name, "part": part, "owner": owner}
        with wrap_errors():
            return self.conn.execute(self._q[query], params).fetchone() is not None

    # -- subscribers -------------------------------------------------------------------

    def get_part(self, name: str, part: int) -> PartState:
        rows = self._parts("get_part", {"name": name, "part": part})
        if not rows:
            raise SubscriberError(f"no subscriber part {name}/{part}")
        return _part(Subscriber.from_dict(rows[0]), rows[0])

    def _parts(self, query: str, params: dict[str, Any]) -> builtins.list[dict[str, Any]]:
        """The rows of ``query`` (get_part, list_parts), each part with its skip list;
        on a schema before migration 0019 (a rolling deploy), of its variant without."""
        without = f"{query}_without_skips"
        info = self.conn.info
        schema = (info.host, info.port, info.dbname, self.schema)
        if time.monotonic() < _WITHOUT_SKIPS.get(schema, 0.0):
            query = without
        cursor = self.conn.cursor(row_factory=dict_row)
        try:
            with wrap_errors():
                return cursor.execute(self._q[query], params).fetchall()
        except DatabaseError as exc:
            in_transaction = self.conn.info.transaction_status != TransactionStatus.IDLE
            if exc.sqlstate != _UNDEFINED_COLUMN or query == without or in_transaction:
                raise
        _WITHOUT_SKIPS[schema] = time.monotonic() + _RECHECK_SKIPS_S
        with wrap_errors():
            return cursor.execute(self._q[without], params).fetchall()

    def get(self, name: str) -> SubscriberState:
        found = self.list(name)
        if not found:
            raise SubscriberError(f"no subscriber named {name!r}")
        return found[0]

    def list(self, name: str | None = None) -> list[SubscriberState]:
        with wrap_errors():
            cursor = self.conn.cursor(row_factory=dict_row)
            subscribers = cursor.execute(self._q["list_subscribers"], {"name": name}).fetchall()
        parts = self._parts("list_parts", {"name": name})
        found = []
        for row in subscribers:
            subscriber = Subscriber.from_dict(row)
            mine = [
                _part(subscriber, p, row["id"]) for p in parts if p["subscriber"] == row["name"]
            ]
            if mine:  # a subscriber created concurrently may not have its parts yet
                found.append(SubscriberState(subscriber, row["id"], mine))
        return found

    def add(
        self,
        subscriber: Subscriber,
        start: StartFrom = StartFrom.BEGINNING,
        *,
        replace: bool = False,
    ) -> bool:
        """Create ``subscriber`` (returns True), or update its definition when ``replace``.

        An existing subscriber keeps its checkpoints: ``start`` applies to new ones only,
        and its part count cannot change. Refused when it could publish an event to a
        topic another subscriber publishes it to.
        """
        listed = self.list()
        for other in listed:
            reason = other.subscriber.name != subscriber.name and collision(
                subscriber, other.subscriber
            )
            if reason:
                raise SubscriberError(
                    f"subscriber {subscriber.name!r} collides with {other.subscriber.name!r}: "
                    f"{reason}; give it a topic of its own (--topic / topic) or filters "
                    "that do not overlap"
                )
        params = {**subscriber.as_dict(), "start": start.value}
        with wrap_errors(), self.conn.transaction():
            created = self.conn.execute(self._q["insert_subscriber"], params).fetchone() is not None
            if created:
                self.conn.execute(self._q["insert_checkpoints"], params)
            elif replace:
                row = self.conn.execute(self._q["update_subscriber"], params).fetchone()
                if row is not None and row[0] != subscriber.parts:
                    raise SubscriberError(
                        f"subscriber {subscriber.name!r} has {row[0]} parts; the part count is "
                        "fixed at creation (remove the subscriber and add it again to change it)"
                    )
            else:
                raise SubscriberError(
                    f"subscriber {subscriber.name!r} already exists; change some of its "
                    f"options with `outbox-relay subscribers set {subscriber.name} --OPTION "
                    "VALUE`, or define it anew with --replace"
                )
            was = next((o.subscriber for o in listed if o.subscriber.name == subscriber.name), None)
            if (
                format_of(subscriber.value_format).registry
                or subscriber.subject_strategy is not SubjectStrategy.TOPIC
                or (was is not None and was.subject_strategy is not SubjectStrategy.TOPIC)
            ):
                self.conn.execute(self._q["set_subject_strategy"], params)
            if not subscriber.routing.default or (was is not None and not was.routing.default):
                # As given (not normalised): the stored definition then equals the
                # configured one, and a relay's sync sees no change to write.
                given = {
                    k: params[k] for k in ("key", "partition_by", "placements", "partition_count")
                }
                routing = None if subscriber.routing.default else Jsonb(given)
                self.conn.execute(self._q["set_routing"], {**params, "routing": routing})
            if format_of(subscriber.value_format).registry:
                self.conn.execute(self._q["set_key_format"], params)
        return created

    def add_all(self, subscribers: Sequence[tuple[Subscriber, StartFrom]]) -> None:
        """:meth:`add` each (``replace``), in one transaction: a refusal of any (a
        collision, a part count) writes none."""
        with wrap_errors(), self.conn.transaction():
            for subscriber, start in subscribers:
                self.add(subscriber, start, replace=True)

    def replace(self, before: Subscriber, after: Subscriber) -> None:
        """Replace the definition ``before`` by ``after`` (as :meth:`add` with
        ``replace``), only if the stored one is still ``before`` (its pause aside):
        a change computed from a definition someone changed meanwhile is refused."""
        with wrap_errors(), self.conn.transaction():
            locked = self.conn.execute(self._q["lock_subscriber"], {"name": before.name})
            if locked.fetchone() is None:
                raise SubscriberError(f"no subscriber named {before.name!r}")
            current = self.get(before.name).subscriber
            if dataclasses.replace(current, paused=before.paused) != before:
                raise SubscriberError(
                    f"subscriber {before.name!r} was changed by someone else meanwhile; "
                    "nothing was written: run the command again"
                )
            self.add(after, replace=True)

    def index_parts(self) -> None:
        """Build the part indexes of every part count in use (relay/adapters/postgres/part_index.py):
        run by `migrate` and `subscribers add`, never by a relay (building one waits
        for every transaction open on the outbox to end)."""
        for parts in sorted({s.subscriber.parts for s in self.list()}):
            part_index.ensure(self.conn, self.schema, parts)

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
        if to is StartFrom.BEGINNING:
            return Position(0, 0)
        horizon = self.horizon()
        if to is StartFrom.NOW:
            return Position(horizon, 0)
        assert isinstance(to, Position)
        if to > Position(horizon, 0):
            raise SubscriberError(
                f"cannot reset {name!r} to {to}: it is beyond what the database has "
                f"decided (the horizon is {horizon}:0; transactions from {horizon} on are "
                "still running or yet to begin), so events written from now on would sort "
                f"before it and never be published. Reset to a point at or below "
                f"{horizon}:0, or to 'now'"
            )
        return to

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
            "aggregate_types": _sorted(subscriber.aggregate_types),
            "event_types": _sorted(subscriber.event_types),
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
        params = {**record.params, "parts": [m.as_dict() for m in moves]}
        entry = self._record(
            dataclasses.replace(record, params=params, events=sum(m.events for m in moves))
        )
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
            refusals = [r for t in targets if (r := t.refusal(name)) is not None]
            if refusals:
                raise SubscriberError("; ".join(refusals))
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
        return sorted({t.part for t in targets if t.halted_on_it and t.part is not None})

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


def _part(
    subscriber: Subscriber, row: dict[str, Any], subscriber_id: UUID | None = None
) -> PartState:
    return PartState(
        subscriber=subscriber,
        subscriber_id=subscriber_id if subscriber_id is not None else row["id"],
        part=row["part"],
        checkpoint=Position(row["transaction_id"], row["position"]),
        version=row["version"],
        generation=row["generation"],
        owner=row["owner"],
        halted_error=row["halted_error"],
        updated_at=row["updated_at"],
        skips=frozenset(row.get("skips") or ()),
    )


def _part_params(state: PartState) -> dict[str, Any]:
    return {
        "transaction_id": state.checkpoint.transaction_id,
        "position": state.checkpoint.position,
        "part": state.part,
        "parts": state.subscriber.parts,
    }


def _sorted(values: frozenset[str] | None) -> list[str] | None:
    return None if values is None else sorted(values)


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
