"""The Postgres side of the relay: reading committed events, subscribers and checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from relay.db import wrap_errors
from relay.errors import CheckpointConflict, SubscriberError
from relay.model import OutboxEvent, Position
from relay.queries import queries_for
from relay.subscribers import StartFrom, Subscriber, ValueFormat, optional_set


@dataclass(frozen=True)
class SubscriberState:
    """A subscriber as stored: its definition, checkpoint and CAS version."""

    subscriber: Subscriber
    checkpoint: Position
    version: int
    updated_at: datetime


class OutboxStore:
    """Queries over one outbox schema, on one connection (autocommit)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        self.conn = conn
        self.schema = schema
        self._q = queries_for(schema)

    # -- the relay's hot path --------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> list[OutboxEvent]:
        """Up to ``limit`` decided events after ``after``, in publication order."""
        params = {
            "transaction_id": after.transaction_id,
            "position": after.position,
            "limit": limit,
        }
        with wrap_errors():
            rows = self.conn.execute(self._q["fetch_batch"], params).fetchall()
        return [OutboxEvent(*row) for row in rows]

    def advance(self, name: str, to: Position, version: int) -> int:
        """Move ``name``'s checkpoint to ``to`` if it is still at ``version``; returns the new version."""
        params = {
            "name": name,
            "transaction_id": to.transaction_id,
            "position": to.position,
            "version": version,
        }
        with wrap_errors():
            row = self.conn.execute(self._q["advance_checkpoint"], params).fetchone()
        if row is None:
            raise CheckpointConflict(
                f"checkpoint of subscriber {name!r} changed underneath this relay"
            )
        return int(row[0])

    def horizon(self) -> int:
        """The oldest running transaction id: everything below it is decided."""
        with wrap_errors():
            row = self.conn.execute(self._q["horizon"]).fetchone()
        assert row is not None
        return int(row[0])

    def pending(self, after: Position) -> int:
        """Outbox rows after ``after``, decided or not (the subscriber's lag in events)."""
        params = {"transaction_id": after.transaction_id, "position": after.position}
        with wrap_errors():
            row = self.conn.execute(self._q["pending_events"], params).fetchone()
        assert row is not None
        return int(row[0])

    # -- subscribers -------------------------------------------------------------------

    def get(self, name: str) -> SubscriberState:
        with wrap_errors():
            row = (
                self.conn.cursor(row_factory=dict_row)
                .execute(self._q["get_subscriber"], {"name": name})
                .fetchone()
            )
        if row is None:
            raise SubscriberError(f"no subscriber named {name!r}")
        return _state(row)

    def list(self) -> list[SubscriberState]:
        with wrap_errors():
            rows = (
                self.conn.cursor(row_factory=dict_row)
                .execute(self._q["list_subscribers"])
                .fetchall()
            )
        return [_state(row) for row in rows]

    def add(
        self,
        subscriber: Subscriber,
        start: StartFrom = StartFrom.BEGINNING,
        *,
        replace: bool = False,
    ) -> bool:
        """Create ``subscriber`` (returns True), or update its definition when ``replace``.

        An existing subscriber keeps its checkpoint: ``start`` applies to new ones only.
        """
        params = {
            "name": subscriber.name,
            "aggregate_types": _sorted(subscriber.aggregate_types),
            "event_types": _sorted(subscriber.event_types),
            "topic": subscriber.topic,
            "value_format": subscriber.value_format.value,
            "start": start.value,
        }
        with wrap_errors(), self.conn.transaction():
            created = self.conn.execute(self._q["insert_subscriber"], params).fetchone() is not None
            if created:
                self.conn.execute(self._q["insert_checkpoint"], params)
            elif replace:
                self.conn.execute(self._q["update_subscriber"], params)
            else:
                raise SubscriberError(f"subscriber {subscriber.name!r} already exists")
        return created

    def set_paused(self, name: str, paused: bool) -> None:
        with wrap_errors():
            rows = self.conn.execute(
                self._q["set_paused"], {"name": name, "paused": paused}
            ).fetchall()
        if not rows:
            raise SubscriberError(f"no subscriber named {name!r}")

    def reset(self, name: str, to: StartFrom | Position) -> None:
        """Move the checkpoint to the beginning, to now, or to just after a position."""
        position = to if isinstance(to, Position) else Position(0, 0)
        params = {
            "name": name,
            "to": "position" if isinstance(to, Position) else to.value,
            "transaction_id": position.transaction_id,
            "position": position.position,
        }
        with wrap_errors():
            rows = self.conn.execute(self._q["reset_checkpoint"], params).fetchall()
        if not rows:
            raise SubscriberError(f"no subscriber named {name!r}")

    def remove(self, name: str) -> None:
        with wrap_errors():
            rows = self.conn.execute(self._q["delete_subscriber"], {"name": name}).fetchall()
        if not rows:
            raise SubscriberError(f"no subscriber named {name!r}")


def _state(row: dict[str, Any]) -> SubscriberState:
    subscriber = Subscriber(
        name=row["name"],
        topic=row["topic"],
        value_format=ValueFormat(row["value_format"]),
        aggregate_types=optional_set(row["aggregate_types"]),
        event_types=optional_set(row["event_types"]),
        paused=row["paused"],
    )
    return SubscriberState(
        subscriber,
        Position(row["transaction_id"], row["position"]),
        row["version"],
        row["updated_at"],
    )


def _sorted(values: frozenset[str] | None) -> Sequence[str] | None:
    return None if values is None else sorted(values)
