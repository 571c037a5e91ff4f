"""A subscriber of one aggregate type reads its own rows only, also mid-backlog (Postgres).

The planner guesses how many rows follow a checkpoint from the statistics of
``transaction_id``; after a checkpoint within (or near the end of) what it has sampled,
it guesses about one. Then every index that can start at the checkpoint looks as cheap
as the type's, and the primary key, which reads every type's rows, was the one it took
(issue #30: 100 subscribers of one type each read the whole table).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.queries import queries_for
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import Position
from relay.core.ports import Selection
from tests.support import outbox_rows_read

TYPES = 10
ROWS = 30_000
LIMIT = 100  # of the 2,900 rows of type3 after the checkpoint: a backlog


@pytest.fixture
def checkpoint(db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]) -> Position:
    """``ROWS`` rows of ``TYPES`` types in turn, in one transaction (as the fan-out
    bench writes them): the key of type3's ``LIMIT``-th row, as a full fetch leaves it."""
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'type' || n %% %s, 'k' || n, 'OrderPlaced', '{}'"
        "   FROM generate_series(1, %s) AS n",
        (TYPES, ROWS),
    )
    db.execute("ANALYZE outbox")  # the owner's (or autovacuum's)
    row = db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox"
        " WHERE aggregate_type = 'type3' ORDER BY transaction_id, position"
        " OFFSET %s LIMIT 1",
        (LIMIT - 1,),
    ).fetchone()
    assert row is not None
    return Position(row[0], row[1])


def poll(checkpoint: Position, part: int = 0, parts: int = 1) -> dict[str, Any]:
    """fetch_batch_of_type's parameters: type3's next ``LIMIT`` rows of ``part``."""
    return {"transaction_id": checkpoint.transaction_id, "position": checkpoint.position,
            "limit": LIMIT, "max_bytes": 2**40, "max_row_bytes": 2**40, "part": part,
            "parts": parts, "event_types": None, "aggregate_type": "type3"}  # fmt: skip


def test_a_one_type_poll_mid_backlog_reads_only_its_types_rows(
    relay_db: psycopg.Connection[Any], checkpoint: Position
) -> None:
    query = queries_for("public")["fetch_batch_of_type"]
    # The batch (and the window's one row of look-ahead), and the newest row once: not
    # the other types' rows in between, nor the newest row again for every row returned.
    assert outbox_rows_read(relay_db, query, poll(checkpoint)) <= LIMIT + 2


def test_a_one_type_poll_of_one_part_reads_only_its_types_rows(
    relay_db: psycopg.Connection[Any], checkpoint: Position
) -> None:
    query = queries_for("public")["fetch_batch_of_type"]
    # The type's rows of every part until the part's LIMIT-th (about 4 x LIMIT), as the
    # range scan finds them: not every type's rows, nor every row of the type.
    assert outbox_rows_read(relay_db, query, poll(checkpoint, part=1, parts=4)) <= 6 * LIMIT


def test_a_one_type_poll_mid_backlog_returns_the_types_next_rows_in_order(
    relay_db: psycopg.Connection[Any], checkpoint: Position
) -> None:
    expected = relay_db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox"
        " WHERE aggregate_type = 'type3' AND (transaction_id, position) > (%s::text::xid8, %s)"
        " ORDER BY transaction_id, position LIMIT %s",
        (checkpoint.transaction_id, checkpoint.position, LIMIT),
    ).fetchall()
    fetched = OutboxStore(relay_db).fetch(
        checkpoint, Selection(LIMIT, aggregate_types=frozenset({"type3"}))
    )
    assert [(e.transaction_id, e.position) for e in fetched.events] == expected
    assert len(expected) == LIMIT and fetched.full
