"""The fetch written once (issue #50, item 6): each rule of the fetch lives in one
fragment of fetch_rules.sql, every fetch query renders it, and a plan per selection
carries its query and its decoder (relay/adapters/postgres/fetch_plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay.adapters.postgres import fetch_plan
from relay.adapters.postgres.queries import parse_named, queries_for, read_sql
from relay.core.model import Position
from relay.core.ports import Selection

SQL_DIR = Path(__file__).resolve().parents[4] / "relay" / "adapters" / "postgres" / "sql"
FETCHES = ("fetch_batch", "fetch_batch_filtered", "fetch_batch_of_type")
RULES = parse_named(read_sql("fetch_rules.sql"))


def _code(text: str) -> str:
    return re.sub(r"--[^\n]*", "", text)


def test_the_size_rule_is_written_once() -> None:
    """pg_column_compression measures a compressed jsonb column: once per such column
    (payload, headers, debezium), in one fragment of the SQL the relay ships (the
    migrations aside: they are history)."""
    found = {
        path.name: _code(path.read_text(encoding="utf-8")).count("pg_column_compression(")
        for path in SQL_DIR.glob("*.sql")
    }
    assert {name: n for name, n in found.items() if n} == {"fetch_rules.sql": 3}
    assert [name for name, body in RULES.items() if "pg_column_compression(" in body] == [
        "row_bytes"
    ]


@pytest.mark.parametrize("query", FETCHES)
def test_every_fetch_renders_every_rule(query: str) -> None:
    rendered = queries_for("public")[query].decode()
    written = parse_named(read_sql("fetch.sql"))[query]
    for name in RULES:
        assert f"{{{name}}}" in written
    assert rendered.count("pg_catalog.pg_column_compression(") == 3
    assert "{" not in _code(rendered).replace("'{}'", "")


def test_no_query_ends_in_the_next_files_comment() -> None:
    """Each .sql file is parsed alone: a file's leading comment (fetch.sql names its
    fragments) is no part of another file's last query."""
    for name, text in queries_for("public").items():
        assert b"The relay's fetches" not in text, name


@pytest.mark.parametrize(
    ("selection", "query"),
    [
        (Selection(10), "fetch_batch"),
        (Selection(10, aggregate_types=frozenset({"order"})), "fetch_batch_of_type"),
        (
            Selection(10, aggregate_types=frozenset({"order"}), event_types=frozenset({"x"})),
            "fetch_batch_of_type",
        ),
        (Selection(10, aggregate_types=frozenset({"order", "invoice"})), "fetch_batch_filtered"),
        (Selection(10, event_types=frozenset({"OrderPlaced"})), "fetch_batch_filtered"),
    ],
)
def test_a_plan_carries_the_query_of_its_selections_filters(
    selection: Selection, query: str
) -> None:
    plan = fetch_plan.plan("public", selection)
    assert (plan.name, plan.query) == (query, queries_for("public")[query])


def test_a_plan_is_chosen_once_per_selection() -> None:
    selection = Selection(10, part=1, parts=2, aggregate_types=frozenset({"order"}))
    assert fetch_plan.plan("public", selection) is fetch_plan.plan("public", selection)
    assert fetch_plan.plan("other", selection).query != fetch_plan.plan("public", selection).query


def test_a_plan_takes_the_checkpoint_per_fetch() -> None:
    plan = fetch_plan.plan("public", Selection(7, part=1, parts=3))
    params = plan.params_after(Position(5, 9))
    assert (params["transaction_id"], params["position"], params["limit"]) == (5, 9, 7)
    assert "transaction_id" not in plan.params
    # A part of several is planned with its part as a constant, never prepared.
    assert not plan.prepare
    assert fetch_plan.plan("public", Selection(7)).prepare
