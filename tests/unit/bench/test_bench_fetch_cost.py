"""The poll-cost sweep's variants (bench/fetch_cost.py) still name text of today's
``fetch_batch``: a rewrite that matched nothing would measure the poll itself under a
variant's name. No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import pytest

from bench.fetch_cost import VARIANTS, rewrite
from relay.adapters.postgres.queries import queries_for

POLL = queries_for("public")["fetch_batch"].decode()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_rewrites_the_poll(name: str) -> None:
    assert rewrite(POLL, VARIANTS[name]) != POLL


def test_a_rewrite_of_text_not_in_the_query_fails() -> None:
    with pytest.raises(ValueError, match="not in the query"):
        rewrite(POLL, (("no such text", "x"),))


def test_a_rewrite_ignores_how_the_text_is_wrapped() -> None:
    assert rewrite("SELECT a,\n       b FROM t", (("a, b", "c"),)) == "SELECT c FROM t"
