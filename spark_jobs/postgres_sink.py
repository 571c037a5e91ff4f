"""An exactly-once Postgres sink for ``foreachBatch``.

Each micro-batch's rows commit in one Postgres transaction together with a
``(sink, batch_id)`` marker row. Spark replays a batch after a driver or executor
crash with the same id and the same data (the source's offsets are in the checkpoint),
so a batch whose marker exists is skipped: the table sees every batch exactly once.

Batch ids only identify a batch within one streaming query, and a query started from a
new checkpoint (a deleted or corrupt checkpoint, a reprocess) is a new query whose ids
start over at 0: skipping them on the old query's markers would silently drop its
rows. So a sink belongs to one query, by the query id Spark keeps in the checkpoint's
``metadata``: the first batch claims an unowned sink (markers from before ownership
was recorded are adopted), and a batch of any other query fails with
:class:`SinkOwnedError`, before anything is written, unless the sink was made with
``take_over=True`` (``--reset-sink``), which drops the old query's markers and claims
the sink. What the old query wrote stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from pyspark.sql import Row

from relay.core.log_fields import log_extra
from relay.errors import RelayError

logger = logging.getLogger(__name__)

MARKERS_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    sink       text NOT NULL,
    batch_id   bigint NOT NULL,
    rows       bigint NOT NULL,
    written_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (sink, batch_id)
)
"""

OWNERS_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    sink      text PRIMARY KEY,
    query_id  text NOT NULL,
    since     timestamptz NOT NULL DEFAULT pg_catalog.now()
)
"""

CORRUPT_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    sink       text NOT NULL,
    batch_id   bigint NOT NULL,
    topic      text NOT NULL,
    partition  integer NOT NULL,
    "offset"   bigint NOT NULL,
    key        text,
    error      text NOT NULL,
    PRIMARY KEY (topic, partition, "offset", sink)
)
"""

# Every connection of the sinks resolves names in pg_catalog first, then in the schema
# their tables live in (the role's own, where they were always created), then pg_temp:
# no function a role puts in that schema (every role may CREATE in `public` before
# Postgres 15) can come before a built-in, and the sinks' SQL calls built-ins only,
# qualified (tests/unit/adapters/postgres/test_sql_qualified.py). Pinned by a query, as the relay pins its
# own (relay/adapters/postgres/db.py): poolers refuse libpq's options. Qualified itself:
# it runs before the path is pinned.
PIN_SEARCH_PATH = """
SELECT pg_catalog.set_config(
    'search_path',
    pg_catalog.concat_ws(', ', 'pg_catalog',
                         pg_catalog.quote_ident(pg_catalog.current_schema()), 'pg_temp'),
    false)
"""

Write = Callable[[psycopg.Connection[Any]], int]


def connect(url: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """A connection of the Spark jobs to their database, its search_path pinned."""
    conn = psycopg.connect(url, autocommit=True)
    try:
        conn.execute(PIN_SEARCH_PATH)
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def create_table(conn: psycopg.Connection[Any], ddl: str, name: str) -> None:
    """Run ``ddl`` (``CREATE TABLE IF NOT EXISTS {table} ...``) for table ``name``, in
    the schema :func:`connect` put after pg_catalog: named in full, as a CREATE of an
    unqualified name picks the path's first schema."""
    row = conn.execute("SELECT pg_catalog.current_schemas(false)").fetchone()
    path = list(row[0]) if row else []
    home = path[1] if len(path) > 1 and not path[1].startswith("pg_temp") else None
    table = sql.Identifier(home, name) if home else sql.Identifier(name)
    conn.execute(sql.SQL(ddl).format(table=table))


RESET_SINK_HELP = (
    "Take the sink over from the query of an earlier checkpoint (after deleting or "
    "replacing the checkpoint): its batch markers are dropped, what it wrote stays."
)


class SinkOwnedError(RelayError):
    """A sink holds the batches of another streaming query (a new checkpoint?)."""


class PostgresBatchSink:
    """Commits what ``write`` does for a micro-batch exactly once (see module doc)."""

    def __init__(
        self,
        url: str,
        sink: str,
        *,
        take_over: bool = False,
        markers_table: str = "spark_sink_batches",
        owners_table: str = "spark_sink_owners",
        corrupt_table: str = "spark_corrupt_records",
    ) -> None:
        self.url = url
        self.sink = sink
        self.take_over = take_over
        self._tables = ((MARKERS_DDL, markers_table), (OWNERS_DDL, owners_table),
                        (CORRUPT_DDL, corrupt_table))  # fmt: skip
        self.markers = sql.Identifier(markers_table)
        self.owners = sql.Identifier(owners_table)
        self.corrupt = sql.Identifier(corrupt_table)

    def ensure_tables(self) -> None:
        with connect(self.url, autocommit=True) as conn:
            for ddl, name in self._tables:
                create_table(conn, ddl, name)

    def claim(self, query_id: str) -> None:
        """Make ``query_id`` the sink's owner, or raise :class:`SinkOwnedError`."""
        with connect(self.url) as conn, conn.transaction():
            self._claim(conn, query_id)

    def commit(self, batch_id: int, write: Write, query_id: str) -> bool:
        """Run ``write`` and record the batch of query ``query_id``, in one transaction;
        False if the batch was already committed (a replay), in which case nothing is
        written."""
        with connect(self.url) as conn, conn.transaction():
            self._claim(conn, query_id)
            claimed = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (sink, batch_id, rows) VALUES (%s, %s, 0) "
                    "ON CONFLICT DO NOTHING RETURNING batch_id"
                ).format(self.markers),
                (self.sink, batch_id),
            ).fetchone()
            if claimed is None:
                logger.info(
                    "sink %s: batch %s already written, skipping",
                    self.sink,
                    batch_id,
                    extra=log_extra("spark_sink_batch_skipped", sink=self.sink, batch_id=batch_id),
                )
                return False
            rows = write(conn)
            conn.execute(
                sql.SQL("UPDATE {} SET rows = %s WHERE sink = %s AND batch_id = %s").format(
                    self.markers
                ),
                (rows, self.sink, batch_id),
            )
        return True

    def _claim(self, conn: psycopg.Connection[Any], query_id: str) -> None:
        row = conn.execute(
            sql.SQL("SELECT query_id FROM {} WHERE sink = %s FOR UPDATE").format(self.owners),
            (self.sink,),
        ).fetchone()
        if row is not None and row[0] == query_id:
            return
        if row is not None and not self.take_over:
            raise SinkOwnedError(
                f"sink {self.sink} holds the batches of streaming query {row[0]}, but this "
                f"query is {query_id}: its checkpoint is new, and its batch ids, which start "
                "over at 0, would be skipped as already written. Pass --reset-sink to take "
                "the sink over (the old query's batch markers are dropped; what it wrote "
                "stays), or restore the old checkpoint"
            )
        if row is not None:
            logger.warning(
                "sink %s: taken over from query %s by %s",
                self.sink,
                row[0],
                query_id,
                extra=log_extra(
                    "spark_sink_taken_over", sink=self.sink, previous_query=row[0], query=query_id
                ),
            )
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE sink = %s").format(self.markers), (self.sink,)
            )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (sink, query_id) VALUES (%s, %s) ON CONFLICT (sink) "
                "DO UPDATE SET query_id = EXCLUDED.query_id, since = now()"
            ).format(self.owners),
            (self.sink, query_id),
        )

    def write_corrupt(
        self, conn: psycopg.Connection[Any], batch_id: int, rows: Sequence[Row]
    ) -> None:
        """Route undecodable records, and events a job cannot apply, to the error table
        (same transaction), each with its reason."""
        with conn.cursor() as cursor:
            cursor.executemany(
                sql.SQL(
                    'INSERT INTO {} (sink, batch_id, topic, partition, "offset", key, error) '
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                ).format(self.corrupt),
                [
                    (self.sink, batch_id, r.topic, r.partition, r.offset,
                     _storable(r.key), _storable(r.error))
                    for r in rows
                ],
            )  # fmt: skip


def _storable(text: str | None) -> str | None:
    """``text`` as Postgres text can hold it: a key or a reason quoting a record's bytes
    may hold NUL, which would fail the batch that quarantines it, again at every run."""
    return None if text is None else text.replace("\x00", "\\x00")
