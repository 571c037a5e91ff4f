"""The dead-letter queries (sql/dead_letters.sql): listing, pruning and the redrive's
own bookkeeping (its lock, its batches' marks), on one autocommit connection. What a
redrive needs of it is ``relay.ops.redrive.RedriveStore``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from relay.adapters.postgres.advisory import session_lock
from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.fetch_plan import load_row_json as _load_row_json
from relay.adapters.postgres.queries import parse_named, read_sql, with_schema
from relay.adapters.postgres.store import OutboxStore
from relay.core.dead_letters import Candidate, ListedDeadLetter
from relay.core.interventions import Intervention
from relay.core.model import OutboxEvent, Position
from relay.core.ports import SubscriberState


class DeadLetterStore:
    """The dead-letter queries on one autocommit connection."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        self.conn = conn
        self.outbox = OutboxStore(conn, schema)
        self._q = {
            name: with_schema(text, schema).as_bytes(None)
            for name, text in parse_named(read_sql("dead_letters.sql")).items()
        }

    def subscriber(self, name: str) -> SubscriberState:
        return self.outbox.get(name)

    def dead_letters(self, name: str, *, include_redriven: bool = False) -> list[ListedDeadLetter]:
        self.subscriber(name)  # a clear error for an unknown name
        with wrap_errors():
            rows = (
                self.conn.cursor(row_factory=dict_row)
                .execute(self._q["list_dead_letters"], {"name": name, "all": include_redriven})
                .fetchall()
            )
        return [
            ListedDeadLetter(
                **{k: v for k, v in row.items() if k not in ("transaction_id", "position")},
                key=Position(row["transaction_id"], row["position"]),
            )
            for row in rows
        ]

    def prune(self, name: str, *, batch: int = 10_000) -> int:
        """Delete ``name``'s redriven dead letters whose rows retention pruned, while no
        redrive of it runs; returns how many."""
        self.subscriber(name)  # a clear error for an unknown name
        with self.exclusive(name):
            return sum(self.outbox.prune_dead_letters(name, batch=batch))

    def pending_before(self, name: str, older_than_s: float) -> list[UUID]:
        """The dead letters not redriven (nor in flight) decided more than
        ``older_than_s`` seconds ago: what ``prune --pending-older-than`` would delete."""
        self.subscriber(name)
        params = {"name": name, "older_than": older_than_s}
        with wrap_errors():
            rows = self.conn.execute(self._q["pending_dead_letters_before"], params).fetchall()
        return [m for (m,) in rows]

    def prune_pending(self, name: str, ids: Sequence[UUID], entry: Intervention) -> int:
        """Delete exactly ``ids`` of ``name``'s dead letters still pending, while no
        redrive of it runs, and put ``entry`` (its count filled in) on the ledger, with
        each event skipped by it, in one transaction; returns how many. They cannot be
        redriven afterwards."""
        with self.exclusive(name), self.conn.transaction(), wrap_errors():
            params: dict[str, Any] = {"name": name, "ids": list(ids)}
            locked = [
                m for (m,) in self.conn.execute(self._q["lock_pending_dead_letter_ids"], params)
            ]
            params |= {"ids": locked, "subscriber_id": entry.subscriber_id}
            params["intervention"] = self.outbox.record(replace(entry, events=len(locked)))
            self.conn.execute(self._q["prune_pending_dead_letter_ids"], params)
        return len(locked)

    def candidates(self, name: str, after: Position, limit: int) -> list[Candidate]:
        params = {
            "name": name,
            "after_tx": after.transaction_id,
            "after_pos": after.position,
            "limit": limit,
        }
        with wrap_errors(), self.conn.cursor(binary=True) as cur:
            # Unloadable JSON is the event's poison, never a failed redrive (as in fetch).
            set_json_loads(_load_row_json, cur)
            rows = cur.execute(self._q["redrive_candidates"], params).fetchall()
        found = []
        for row in rows:
            _, message_id, *event, dead_tx, dead_pos = row
            tx, pos, mid, atype, aid, version, etype, payload, headers, at, size, dbz = event
            found.append(
                Candidate(
                    message_id,
                    Position(dead_tx, dead_pos),
                    None
                    if mid is None
                    else OutboxEvent(
                        tx, pos, mid, atype, aid, version, etype, payload, headers, at, size, dbz
                    ),
                )
            )
        return found

    @contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """Hold the subscriber's redrive lock; :class:`SubscriberError` when another holds it.
        (Kafka fences an earlier redrive too, but only at its next transaction: two
        redrives marking dead letters at once could take each other's marks.)"""
        with session_lock(
            self.conn,
            self._q["redrive_lock"],
            self._q["redrive_unlock"],
            {"name": name},
            f"redrive of subscriber {name!r}",
        ):
            yield

    def settle(self, name: str, committed: int) -> tuple[int, int]:
        """Mark batch ``committed`` redriven and clear any other in flight; returns the
        dead letters marked and the highest batch number used so far."""
        with wrap_errors():
            row = self.conn.execute(
                self._q["redrive_settle"], {"name": name, "committed": committed}
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def begin(self, name: str, batch: int, ids: Sequence[UUID]) -> None:
        self._run("redrive_begin", name=name, batch=batch, ids=list(ids))

    def abandon(self, name: str, batch: int) -> None:
        self._run("redrive_abandon", name=name, batch=batch)

    def done(self, name: str, batch: int) -> None:
        self._run("redrive_done", name=name, batch=batch)

    def refused(self, name: str, message_id: UUID, error: str) -> None:
        self._run("redrive_refused", name=name, message_id=message_id, error=error)

    def _run(self, query: str, **params: Any) -> None:
        with wrap_errors():
            self.conn.execute(self._q[query], params)
