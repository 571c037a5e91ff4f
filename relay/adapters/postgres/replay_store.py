"""The replays' queries (``sql/replay.sql``): a range's events, the replays on the
ledger, and the lock that keeps two runs of one subscriber's replay apart."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import psycopg

from relay.adapters.postgres.advisory import session_lock
from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import parse_named, read_sql, with_schema
from relay.core.model import Position
from relay.core.replay import OpenReplay, ReplayRange, unfinished


class ReplayStore:
    """The replay's queries (relay/adapters/postgres/sql/replay.sql) on one autocommit
    connection."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        self.conn = conn
        self._q = {
            name: with_schema(text, schema).as_bytes(None)
            for name, text in parse_named(read_sql("replay.sql")).items()
        }

    def count(self, wanted: ReplayRange) -> int:
        with wrap_errors():
            row = self.conn.execute(self._q["replay_range"], wanted.query_params()).fetchone()
        assert row is not None
        return int(row[0])

    def events(self, wanted: ReplayRange) -> list[tuple[UUID, Position, str, str]]:
        """The events of the range (message id, key, aggregate type, event type)."""
        with wrap_errors():
            rows = self.conn.execute(self._q["replay_events"], wanted.query_params()).fetchall()
        return [(mid, Position(tx, pos), atype, etype) for mid, tx, pos, atype, etype in rows]

    def replays(self, subscriber_id: UUID) -> list[OpenReplay]:
        with wrap_errors():
            rows = self.conn.execute(
                self._q["replays"], {"subscriber_id": subscriber_id}
            ).fetchall()
        return [
            OpenReplay(entry, ReplayRange.from_args(args), events or 0, done)
            for entry, args, events, done in rows
        ]

    def open(self, subscriber_id: UUID, wanted: ReplayRange) -> OpenReplay | None:
        """The replay with these arguments that has not finished, if any."""
        return unfinished(self.replays(subscriber_id), wanted)

    @contextmanager
    def exclusive(self, name: str, subscriber_id: UUID) -> Iterator[None]:
        """Hold the subscriber's replay lock; :class:`SubscriberError` when another
        replay of it holds it."""
        with session_lock(
            self.conn,
            self._q["replay_lock"],
            self._q["replay_unlock"],
            {"subscriber_id": subscriber_id},
            f"replay of subscriber {name!r}",
        ):
            yield
