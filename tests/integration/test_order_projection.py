"""``verify --through projection``'s reader (relay/adapters/postgres/projection.py)
against a real database: one connection per read, the quarantined keys and the rows on
it, the rows through a server-side cursor (a chunk at a time, not the whole table)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import projection
from relay.adapters.postgres.projection import OrderProjection
from relay.core.model import Position
from relay.core.ports import ProjectedRow
from relay.errors import SinkUnreadable
from tests.support import wait_until

_ROWS = 2_500


_SESSIONS = (
    "SELECT query FROM pg_stat_activity"
    " WHERE application_name = 'outbox-relay-verify' AND datname = current_database()"
)


@pytest.fixture
def owner(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """The projection's own database, its tables made as their owner, as the Spark job
    makes them (spark_jobs/order_projection.py, postgres_sink.py)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        _tables(conn)
        yield conn


def _tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE orders (order_id text PRIMARY KEY, status text NOT NULL,"
        " transaction_id bigint NOT NULL, position bigint NOT NULL)"
    )
    conn.execute("CREATE TABLE spark_corrupt_records (sink text NOT NULL, key text)")
    conn.execute(
        "INSERT INTO orders SELECT 'o-' || n, 'placed', n, 0 FROM generate_series(1, %s) n",
        (_ROWS,),
    )
    conn.execute(
        "INSERT INTO spark_corrupt_records VALUES"
        " ('order-projection', 'o-bad'), ('order-projection', 'o-bad'),"
        " ('order-projection', NULL), ('archive', 'o-other')"
    )


def test_one_read_is_one_connection_its_rows_fetched_a_chunk_at_a_time(
    owner: psycopg.Connection[Any], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection, "_FETCH", 1_000)
    rows: list[ProjectedRow] = []
    with OrderProjection(database_url).read() as read:
        assert read.quarantined == {"o-bad"}  # the job's sink's, with a key
        for row in read.rows:
            if not rows:  # mid-stream: one session, fetching from its cursor
                [(query,)] = owner.execute(_SESSIONS).fetchall()
                assert query.startswith("FETCH FORWARD 1000"), query
            rows.append(row)
    assert len(rows) == _ROWS
    assert sorted(rows)[0] == ProjectedRow("o-1", Position(1, 0))
    _closed(owner)  # with the read


def test_a_read_stopped_early_closes_its_cursor_and_connection(
    owner: psycopg.Connection[Any], database_url: str
) -> None:
    with OrderProjection(database_url).read() as read:
        next(read.rows)
    _closed(owner)
    with OrderProjection(database_url).read() as again:
        assert sum(1 for _ in again.rows) == _ROWS


def test_tables_it_cannot_read_are_unreadable_on_entering_or_while_reading(
    owner: psycopg.Connection[Any], database_url: str
) -> None:
    owner.execute("DROP TABLE orders")
    reader = OrderProjection(database_url)
    # The quarantined keys are readable; the rows are not.
    with reader.read() as read, pytest.raises(SinkUnreadable, match="orders"):
        list(read.rows)
    owner.execute("DROP TABLE spark_corrupt_records")
    with pytest.raises(SinkUnreadable, match="spark_corrupt_records"), reader.read():
        pass


def _closed(owner: psycopg.Connection[Any]) -> None:
    """The reader's session is gone (its backend exits just after the client closes)."""
    wait_until(lambda: not owner.execute(_SESSIONS).fetchall(), what="the read's session closed")
