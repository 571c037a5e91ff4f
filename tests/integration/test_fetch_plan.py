"""The columns each fetch returns are those its plan reads (Postgres): the fetches read
their rows by position, for speed, so the names and order the SQL gives them are checked
here, once, rather than per row (relay/adapters/postgres/fetch_plan.py)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import fetch_plan
from relay.core.model import Position
from relay.core.ports import Selection


@pytest.mark.parametrize(
    "selection",
    [
        Selection(10),
        Selection(10, aggregate_types=frozenset({"order", "invoice"})),
        Selection(10, aggregate_types=frozenset({"order"})),
    ],
    ids=["unfiltered", "filtered", "of type"],
)
def test_a_fetch_returns_the_columns_its_plan_reads(
    relay_db: psycopg.Connection[Any], selection: Selection
) -> None:
    plan = fetch_plan.plan("public", selection)
    with relay_db.cursor(binary=True) as cur:
        cur.execute(plan.query, plan.params_after(Position(0, 0)), prepare=plan.prepare)
        names = tuple(column.name for column in cur.description or ())
    assert names == plan.read + fetch_plan.EVENT_COLUMNS
    assert len(plan.read) == (0 if plan.name == "fetch_batch" else 3)
