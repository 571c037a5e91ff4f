"""An idle relay's queries read a row or two of the outbox, however big it is (Postgres).

The commit probe runs several times a second, and every part of a one-type subscriber
polls on a timer: a query among them that falls back to a sequential scan reads the
whole table each time, which on a large retained outbox keeps a core busy doing nothing.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.queries import queries_for
from tests.support import outbox_rows_read

ROWS = 20_000


@pytest.fixture
def published(db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]) -> tuple[int, int]:
    """A table of ``ROWS`` decided rows, all of them published: the newest row's key."""
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'order', 'k' || n, 'OrderPlaced', '{}' FROM generate_series(1, %s) AS n",
        (ROWS,),
    )
    db.execute("ANALYZE outbox")  # the owner's (or autovacuum's)
    newest = db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox"
        " ORDER BY transaction_id DESC, position DESC LIMIT 1"
    ).fetchone()
    assert newest is not None
    return newest[0], newest[1]


def test_the_commit_probe_reads_one_row_when_no_transaction_runs(
    relay_db: psycopg.Connection[Any], published: tuple[int, int]
) -> None:
    query = queries_for("public")["newest_decided"]
    assert relay_db.execute(query).fetchone() == (str(published[0]), published[1], False)
    assert outbox_rows_read(relay_db, query) <= 2


def test_a_caught_up_one_type_poll_reads_one_row(
    relay_db: psycopg.Connection[Any], published: tuple[int, int]
) -> None:
    query = queries_for("public")["fetch_batch_of_type"]
    params = {"transaction_id": published[0], "position": published[1], "limit": 5000,
              "max_bytes": 2**40, "max_row_bytes": 2**40, "part": 0, "parts": 1, "event_types": None,
              "aggregate_type": "order"}  # fmt: skip
    assert relay_db.execute(query, params).fetchall() == []  # nothing new: no checkpoint write
    assert outbox_rows_read(relay_db, query, params) <= 2
