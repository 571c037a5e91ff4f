"""An exactly-once Postgres sink for ``foreachBatch``.

Each micro-batch's rows commit in one Postgres transaction together with a
``(sink, batch_id)`` marker row. Spark replays a batch after a driver or executor
crash with the same id and the same data (the source's offsets are in the checkpoint),
so a batch whose marker exists is skipped: the table sees every batch exactly once.
``sink`` names the query; keep it stable for as long as its checkpoint lives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from pyspark.sql import Row

logger = logging.getLogger(__name__)

MARKERS_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    sink       text NOT NULL,
    batch_id   bigint NOT NULL,
    rows       bigint NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sink, batch_id)
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

Write = Callable[[psycopg.Connection[Any]], int]


class PostgresBatchSink:
    """Commits what ``write`` does for a micro-batch exactly once (see module doc)."""

    def __init__(
        self,
        url: str,
        sink: str,
        *,
        markers_table: str = "spark_sink_batches",
        corrupt_table: str = "spark_corrupt_records",
    ) -> None:
        self.url = url
        self.sink = sink
        self.markers = sql.Identifier(markers_table)
        self.corrupt = sql.Identifier(corrupt_table)

    def ensure_tables(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL(MARKERS_DDL).format(table=self.markers))
            conn.execute(sql.SQL(CORRUPT_DDL).format(table=self.corrupt))

    def commit(self, batch_id: int, write: Write) -> bool:
        """Run ``write`` and record the batch, in one transaction; False if the batch
        was already committed (a replay), in which case nothing is written."""
        with psycopg.connect(self.url) as conn, conn.transaction():
            claimed = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (sink, batch_id, rows) VALUES (%s, %s, 0) "
                    "ON CONFLICT DO NOTHING RETURNING batch_id"
                ).format(self.markers),
                (self.sink, batch_id),
            ).fetchone()
            if claimed is None:
                logger.info("sink %s: batch %s already written, skipping", self.sink, batch_id)
                return False
            rows = write(conn)
            conn.execute(
                sql.SQL("UPDATE {} SET rows = %s WHERE sink = %s AND batch_id = %s").format(
                    self.markers
                ),
                (rows, self.sink, batch_id),
            )
        return True

    def write_corrupt(
        self, conn: psycopg.Connection[Any], batch_id: int, rows: Sequence[Row]
    ) -> None:
        """Route undecodable records to the error table (same transaction)."""
        with conn.cursor() as cursor:
            cursor.executemany(
                sql.SQL(
                    'INSERT INTO {} (sink, batch_id, topic, partition, "offset", key, error) '
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                ).format(self.corrupt),
                [
                    (self.sink, batch_id, r.topic, r.partition, r.offset, r.key, r.error)
                    for r in rows
                ],
            )
