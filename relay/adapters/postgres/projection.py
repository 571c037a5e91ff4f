"""The order projection (``spark_jobs/order_projection.py``) read back for ``verify
--through projection``: its ``orders`` rows (one per order, at the last event applied)
and the keys of the events it quarantined (``spark_corrupt_records``), queries of
``sql/projection.sql``.

The database is the projection's own (its URL: ``verify --through projection URL``, or
``RELAY_SINK_URL`` / ``RELAY_SINK_URL_FILE``), read as the job's role finds its tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg

from relay.adapters.postgres import db
from relay.adapters.postgres.queries import parse_named, read_sql
from relay.core.model import Position
from relay.core.ports import ProjectedRow
from relay.errors import ConfigError, SinkUnreadable

# The events the job applies (spark_jobs/order_projection.py, _judged and _STATUS): an
# order aggregate's events whose type ends with one of these.
_AGGREGATE_TYPE = "order"
_EVENT_TYPES = ("OrderPlaced", "OrderShipped")
_SINK = "order-projection"  # the job's default --sink: its rows in the error table


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

    def rows(self) -> Iterator[ProjectedRow]:
        rows = self._read("projected_rows", {})
        return (ProjectedRow(key, Position(tx, pos)) for key, tx, pos in rows)

    def quarantined_keys(self) -> set[str]:
        return {key for (key,) in self._read("quarantined_keys", {"sink": _SINK})}

    def _read(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with db.connect(self._url, application_name="outbox-relay-verify") as conn:
            try:
                conn.execute(self._queries["role_search_path"])
                conn.execute(self._queries["pin_sink_search_path"])
                return conn.execute(self._queries[name], params).fetchall()
            except psycopg.Error as exc:  # no such table, not allowed to read it...
                raise SinkUnreadable(f"the projection's database: {exc}") from exc
