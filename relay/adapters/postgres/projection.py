"""The order projection (``spark_jobs/order_projection.py``) read back for ``verify
--through projection``: its ``orders`` rows (one per order, at the last event applied)
and the keys of the events it quarantined (``spark_corrupt_records``), queries of
``sql/projection.sql``, on one connection per read, the rows streamed.

The database is the projection's own (its URL: ``verify --through projection URL``, or
``RELAY_SINK_URL`` / ``RELAY_SINK_URL_FILE``), read as the job's role finds its tables.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from relay.adapters.postgres import db
from relay.adapters.postgres.queries import parse_named, read_sql
from relay.core.model import Position
from relay.core.ports import ProjectedRow, ProjectionRead
from relay.errors import ConfigError, SinkUnreadable

# The events the job applies (spark_jobs/order_projection.py, _judged and _STATUS): an
# order aggregate's events whose type ends with one of these.
_AGGREGATE_TYPE = "order"
_EVENT_TYPES = ("OrderPlaced", "OrderShipped")
_SINK = "order-projection"  # the sink name main gives the job (start(sink=...)): its error rows
_FETCH = 10_000  # rows fetched at a time: memory does not grow with the table


class OrderProjection:
    """The ``orders`` projection in the database at ``url``."""

    key_field = "order_id"

    def __init__(self, url: str) -> None:
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("--through projection takes the projection database's URL")
        self._url = url
        self._queries = {k: v.encode() for k, v in parse_named(read_sql("projection.sql")).items()}

    def projects(self, aggregate_type: str, event_type: str) -> bool:
        return aggregate_type == _AGGREGATE_TYPE and event_type.endswith(_EVENT_TYPES)

    @contextmanager
    def read(self) -> Iterator[ProjectionRead]:
        with db.connect(self._url, application_name="outbox-relay-verify") as conn:
            quarantined = self._quarantined(conn)
            rows = self._rows(conn)
            try:
                yield ProjectionRead(quarantined, rows)
            finally:
                rows.close()  # its cursor, before the connection closes under it

    def _quarantined(self, conn: psycopg.Connection[Any]) -> set[str]:
        """Pins the path the job's tables are found on (for the rows too), then reads
        the quarantined keys."""
        with _unreadable():
            conn.execute(self._queries["role_search_path"])
            conn.execute(self._queries["pin_sink_search_path"])
            found = conn.execute(self._queries["quarantined_keys"], {"sink": _SINK})
            return {key for (key,) in found}

    def _rows(self, conn: psycopg.Connection[Any]) -> Generator[ProjectedRow]:
        """The rows through a server-side cursor, ``_FETCH`` at a time: a named cursor
        lives in a transaction (the connection is in autocommit)."""
        with _unreadable(), conn.transaction(), conn.cursor(name="projected_rows") as cursor:
            cursor.itersize = _FETCH
            cursor.execute(self._queries["projected_rows"])
            for key, tx, pos in cursor:
                yield ProjectedRow(key, Position(tx, pos))


@contextmanager
def _unreadable() -> Iterator[None]:
    try:
        yield
    except psycopg.Error as exc:  # no such table, not allowed to read it...
        raise SinkUnreadable(f"the projection's database: {exc}") from exc
