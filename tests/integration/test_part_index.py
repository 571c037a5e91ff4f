"""Part indexes: each part of a sharded subscriber reads only its own rows (Postgres)."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from relay.adapters.postgres.queries import queries_for
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import Position
from relay.core.ports import Selection
from relay.core.subscribers import StartFrom, Subscriber
from tests.support import outbox_rows_read, run_cli

ROWS = 2000


def part_indexes(db: psycopg.Connection[Any]) -> list[str]:
    rows = db.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = 'outbox'"
        " AND indexname LIKE 'outbox\\_part\\_%' ORDER BY indexname"
    ).fetchall()
    return [name for (name,) in rows]


def fill(db: psycopg.Connection[Any]) -> None:
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'order', 'k' || n, 'OrderPlaced', '{}' FROM generate_series(1, %s) AS n",
        (ROWS,),
    )
    db.execute("ANALYZE outbox")


def rows_read(db: psycopg.Connection[Any], part: int, parts: int) -> int:
    """Rows of the outbox the poll of ``part`` reads, its own or not."""
    params = {"transaction_id": 0, "position": 0, "limit": 100, "max_bytes": 2**40,
              "max_row_bytes": 2**40,
              "part": part, "parts": parts, "aggregate_types": None, "event_types": None}  # fmt: skip
    return outbox_rows_read(db, queries_for("public")["fetch_batch"], params)


def test_adding_a_sharded_subscriber_indexes_its_parts_and_each_reads_only_its_own(
    database_url: str, db: psycopg.Connection[Any], relay_db: psycopg.Connection[Any]
) -> None:
    fill(db)
    # As the owner: building the part indexes needs it (deploy/README.md).
    added = run_cli("subscribers", "add", "s", "--parts", "4", "--database-url", database_url)
    assert added.returncode == 0, added.stderr
    assert part_indexes(db) == [f"outbox_part_4_{p}" for p in range(4)]
    store = OutboxStore(relay_db)  # the polls are the relay's
    seen: list[str] = []
    for part in range(4):
        events = store.fetch(Position(0, 0), Selection(ROWS, part=part, parts=4)).events
        owners = db.execute(
            "SELECT DISTINCT outbox_part(aggregate_id, 4) FROM outbox WHERE aggregate_id = ANY(%s)",
            ([e.aggregate_id for e in events],),
        ).fetchall()
        assert owners == [(part,)]
        seen += [e.aggregate_id for e in events]
        # Its first 100 rows, read through its own index (a row or two past the limit),
        # not the 400 or so of every part that a scan of the range reads to find them.
        assert rows_read(relay_db, part, 4) <= 110
    assert sorted(seen) == sorted(f"k{n}" for n in range(1, ROWS + 1))


def test_the_last_subscriber_of_a_part_count_takes_its_indexes_along(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    for name in ("a", "b"):
        cli = run_cli("subscribers", "add", name, "--parts", "2", "--topic", name,
                      "--database-url", database_url)  # fmt: skip
        assert cli.returncode == 0, cli.stderr
    assert run_cli("subscribers", "remove", "a", "--database-url", database_url).returncode == 0
    assert part_indexes(db) == ["outbox_part_2_0", "outbox_part_2_1"]
    assert run_cli("subscribers", "remove", "b", "--database-url", database_url).returncode == 0
    assert part_indexes(db) == []


def test_migrate_builds_the_part_indexes_a_relay_could_not(
    database_url: str, db: psycopg.Connection[Any], relay_db: psycopg.Connection[Any]
) -> None:
    """A relay declares its sharded subscribers itself but never builds indexes (that
    waits on every open transaction); the owner's `migrate` does."""
    store = OutboxStore(relay_db)
    store.add(Subscriber("declared", topic="t", parts=3), StartFrom.BEGINNING)
    assert part_indexes(db) == []
    migrated = run_cli("migrate", "--database-url", database_url)
    assert migrated.returncode == 0, migrated.stderr
    assert part_indexes(db) == [f"outbox_part_3_{p}" for p in range(3)]
    assert json.loads(run_cli("subscribers", "list", "--json", "--database-url",
                              database_url).stdout)[0]["name"] == "declared"  # fmt: skip
