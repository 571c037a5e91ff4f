"""One part of a sharded subscriber reads its own rows only, also mid-backlog and also
with filters (Postgres).

A part's poll is planned with its part as a constant, so that the planner may take the
part's index (relay/adapters/postgres/part_index.py); a plan that cannot (a generic
plan, or a part test that no longer matches the index's predicate) takes the primary
key and reads every part's rows, 4x here. Mid-backlog the planner guesses about one row
after the checkpoint (issue #30): then every index that starts there looks as cheap.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import part_index
from relay.adapters.postgres.queries import queries_for
from relay.core.model import Position
from tests.support import outbox_rows_read

PARTS, PART = 4, 1
TYPES = 10
ROWS = 20_000
LIMIT = 100  # of the part's 5,000 or so rows: a backlog
FILTERS = {
    "fetch_batch": {"aggregate_types": None, "event_types": None},
    "fetch_batch_filtered": {"aggregate_types": ["type1", "type4", "type7"],
                             "event_types": ["OrderPaid"]},
}  # fmt: skip


@pytest.fixture
def checkpoint(db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]) -> Position:
    """``ROWS`` rows of ``TYPES`` types and two event types in turn, in one transaction
    (as the benches write them), and the part indexes of ``PARTS`` parts: the key of the
    part's ``LIMIT``-th row, as a full fetch leaves it."""
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'type' || n %% %s, 'k' || n,"
        "        CASE WHEN n %% 2 = 0 THEN 'OrderPaid' ELSE 'OrderPlaced' END, '{}'"
        "   FROM generate_series(1, %s) AS n",
        (TYPES, ROWS),
    )
    assert part_index.ensure(db, "public", PARTS)  # the owner's (`subscribers add`)
    db.execute("ANALYZE outbox")  # the owner's (or autovacuum's)
    row = db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox"
        " WHERE outbox_part(aggregate_id, %s) = %s ORDER BY transaction_id, position"
        " OFFSET %s LIMIT 1",
        (PARTS, PART, LIMIT - 1),
    ).fetchone()
    assert row is not None
    return Position(row[0], row[1])


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_a_part_poll_mid_backlog_reads_only_its_parts_rows(
    relay_db: psycopg.Connection[Any], checkpoint: Position, name: str
) -> None:
    # Unprepared, as OutboxStore.fetch runs a part's poll: a custom plan.
    params = {"transaction_id": checkpoint.transaction_id, "position": checkpoint.position,
              "limit": LIMIT, "max_bytes": 2**40, "max_row_bytes": 2**40, "part": PART,
              "parts": PARTS, "aggregate_type": None, **FILTERS[name]}  # fmt: skip
    # The batch and a row or two of the windows' look-ahead: not the other parts' rows
    # in between (a part test the index cannot serve read 491 here).
    assert outbox_rows_read(relay_db, queries_for("public")[name], params) <= LIMIT + 2
