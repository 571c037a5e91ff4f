"""What verify reads of the outbox (``sql/verify.sql``) and of the replays
(``sql/replay.sql``), on one connection: the ``VerifyOutbox`` port."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
from uuid import UUID

import psycopg

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import queries_for
from relay.adapters.postgres.replay_store import ReplayStore
from relay.core.model import Position
from relay.core.ports import EventKeys, PublishedEvent
from relay.core.subscribers import Subscriber

_ITERSIZE = 10_000  # rows the named cursor fetches per round trip


class PostgresVerifyOutbox(ReplayStore):
    """The verify queries on ``conn``, besides the replays' (inherited)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        super().__init__(conn, schema)
        self._schema = schema

    def published_events(self, subscriber: Subscriber) -> Iterator[PublishedEvent]:
        query = queries_for(self._schema)["published_events"]
        # A named (server-side) cursor: a subscriber's events may not fit in memory twice.
        with wrap_errors(), self.conn.transaction(), self.conn.cursor(name="verify") as cursor:
            cursor.itersize = _ITERSIZE
            cursor.execute(query, subscriber.as_dict())  # its name and filters
            for mid, tx, pos, aggregate_type, event_type, dead, redriven, part in cursor:
                yield PublishedEvent(
                    mid, Position(tx, pos), aggregate_type, event_type, dead, redriven, part
                )

    def part_starts(self, name: str) -> list[tuple[int, Position]]:
        with wrap_errors():
            rows = self.conn.execute(
                queries_for(self._schema)["part_starts"], {"name": name}
            ).fetchall()
        return [(part, Position(tx, pos)) for part, tx, pos in rows]

    def placed(self, name: str, ids: Sequence[UUID]) -> dict[UUID, str]:
        query = queries_for(self._schema)["placed_messages"]
        with wrap_errors():
            rows = self.conn.execute(query, {"name": name, "ids": list(ids)}).fetchall()
        return dict(rows)

    def event_keys(self, ids: Sequence[UUID], field: str) -> dict[UUID, EventKeys]:
        query = queries_for(self._schema)["event_keys"]
        with wrap_errors():
            rows = self.conn.execute(query, {"ids": list(ids), "field": field}).fetchall()
        return {mid: EventKeys(*keys) for mid, *keys in rows}

    def message_ids_at(self, positions: Sequence[Position]) -> dict[Position, UUID]:
        query = queries_for(self._schema)["message_ids_at"]
        params = {
            "transaction_ids": [p.transaction_id for p in positions],
            "positions": [p.position for p in positions],
        }
        with wrap_errors():
            rows = self.conn.execute(query, params).fetchall()
        return {Position(tx, pos): mid for tx, pos, mid in rows}
