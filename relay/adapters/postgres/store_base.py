"""What the pieces of :class:`~relay.adapters.postgres.store.OutboxStore` share: one
connection, one outbox schema and its named queries. Each piece is a class of its own
module (its sessions, its interventions, ...), and the store inherits them all: its
callers and the ports see one class."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import psycopg

from relay.adapters.postgres.queries import queries_for


class StoreBase:
    """The connection (autocommit), the schema and its named queries every piece of the
    store runs on."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "public") -> None:
        self.conn = conn
        self.schema = schema
        self._q = queries_for(schema)

    def transaction(self) -> AbstractContextManager[Any]:
        """A transaction on the store's connection (a savepoint within one): the calls
        made inside it commit together, or not at all."""
        return self.conn.transaction()


def sorted_or_none(values: frozenset[str] | None) -> list[str] | None:
    return None if values is None else sorted(values)
