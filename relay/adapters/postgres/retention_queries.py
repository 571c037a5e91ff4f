"""The outbox store's retention: published rows and dead letters pruned, a batch per
transaction (a piece of :class:`~relay.adapters.postgres.store.OutboxStore`)."""

from __future__ import annotations

from collections.abc import Iterator

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.store_base import StoreBase
from relay.errors import UndefinedFunctionError


class RetentionQueries(StoreBase):
    """What the relay's upkeep and ``outbox-relay prune`` delete."""

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
