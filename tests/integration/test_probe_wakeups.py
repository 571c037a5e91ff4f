"""The commit probe says which aggregate types a change concerns (Postgres), so that a
relay wakes only the parts that can have rows of them (issue #30, fan-out cost)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from relay.adapters.postgres.probe import CommitProbe
from relay.adapters.postgres.queries import queries_for
from tests.support import outbox_rows_read, wait_until


def _append(writer_db: psycopg.Connection[Any], *types: str) -> None:
    with writer_db.transaction():
        for n, aggregate_type in enumerate(types):
            writer_db.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES (%s, %s, 'Happened', '{}')",
                (aggregate_type, f"k{n}"),
            )


def test_the_probe_wakes_with_the_aggregate_types_committed_since_its_last_look(
    relay_url: str, writer_db: psycopg.Connection[Any]
) -> None:
    _append(writer_db, "before")
    woken: list[frozenset[str] | None] = []
    lock = threading.Lock()

    def wake(types: frozenset[str] | None = None) -> None:
        with lock:
            woken.append(types)

    def seen() -> list[frozenset[str] | None]:
        with lock:
            return list(woken)

    probe = CommitProbe(
        lambda: psycopg.connect(relay_url), "public", wake, interval=0.01, idle_interval=0.01
    )
    probe.start()
    try:
        wait_until(lambda: seen() == [None], what="the first look: every part")
        _append(writer_db, "alpha")
        wait_until(lambda: len(seen()) == 2, what="a wake-up for alpha")
        _append(writer_db, "beta", "gamma", "beta")
        wait_until(lambda: len(seen()) >= 3, what="a wake-up for beta and gamma")
    finally:
        probe.stop()
        probe.join(10)
    assert seen()[1] == frozenset({"alpha"})
    # Each wake-up names the types committed since the one before, and nothing else.
    later = set().union(*(types or {"?"} for types in seen()[2:]))
    assert later == {"beta", "gamma"}


def test_the_probes_type_query_reads_only_the_rows_since_its_last_look(
    db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
) -> None:
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'type' || (n % 7), 'k' || n, 'Happened', '{}' FROM generate_series(1, 20000) n"
    )
    writer_db.commit()
    _append(writer_db, "late", "later")
    db.execute("ANALYZE outbox")
    keys = db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox"
        " ORDER BY transaction_id DESC, position DESC LIMIT 3"
    ).fetchall()
    (upto_tx, upto_pos), _, (after_tx, after_pos) = keys
    query = queries_for("public")["decided_types_between"]
    params = {"after_transaction_id": str(after_tx), "after_position": after_pos,
              "upto_transaction_id": str(upto_tx), "upto_position": upto_pos, "limit": 1000}  # fmt: skip
    assert relay_db.execute(query, params).fetchone() == (["late", "later"], 2)
    assert outbox_rows_read(relay_db, query, params) <= 3  # a range scan of the new rows
