"""The Postgres side of the relay: committed events, subscribers, parts and sessions.

:class:`OutboxStore` is the Postgres adapter of the daemon's store port
(``relay.core.ports.DaemonStore``, which extends the part worker's ``PartStore``), and more:
the operators' commands (status, lag, reset, remove) use it directly. Its sessions, its
interventions, its key space and its retention are pieces of their own modules
(``session_queries``, ``intervention_queries``, ``key_space_queries``,
``retention_queries``), on the connection and schema of ``store_base``."""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from relay.adapters.postgres import fetch_plan, part_index
from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.intervention_queries import InterventionQueries
from relay.adapters.postgres.key_space_queries import KeySpaceQueries
from relay.adapters.postgres.retention_queries import RetentionQueries
from relay.adapters.postgres.session_queries import SessionQueries
from relay.adapters.postgres.store_base import sorted_or_none
from relay.core import ports
from relay.core.formats import format_of
from relay.core.model import PartId, Position
from relay.core.ports import (
    DeadLetter,
    DeadLetterDecision,
    Fetched,
    HorizonHolder,
    LagSample,
    PartSkips,
    PartState,
    PartWait,
    Selection,
)
from relay.core.subscribers import (
    StartFrom,
    SubjectStrategy,
    Subscriber,
    check_unchanged,
    collision,
)
from relay.errors import (
    CheckpointConflict,
    ClaimLost,
    DatabaseError,
    SubscriberError,
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


class OutboxStore(SessionQueries, InterventionQueries, KeySpaceQueries, RetentionQueries):
    """Queries over one outbox schema, on one connection (autocommit)."""

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
            fetch_plan.set_loaders(cur)
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
            "aggregate_types": sorted_or_none(state.subscriber.aggregate_types),
            "event_types": sorted_or_none(state.subscriber.event_types),
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
            check_unchanged(self.get(before.name).subscriber, before)
            self.add(after, replace=True)

    def index_parts(self) -> None:
        """Build the part indexes of every part count in use (relay/adapters/postgres/part_index.py):
        run by `migrate` and `subscribers add`, never by a relay (building one waits
        for every transaction open on the outbox to end)."""
        for parts in sorted({s.subscriber.parts for s in self.list()}):
            part_index.ensure(self.conn, self.schema, parts)


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
