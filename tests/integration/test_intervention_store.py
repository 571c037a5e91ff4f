"""Issue #48, the Postgres store as the relay role (which the CLI runs as): what a reset
of a subscriber of several parts counts, per part, each from its own checkpoint, is
what it skips and what status then reports, with the events skipped already left out."""

from __future__ import annotations

from typing import Any

import psycopg

from relay.adapters.postgres.store import OutboxStore
from relay.core.interventions import Action, Actor, Intervention
from relay.core.model import Position
from relay.core.subscribers import Subscriber, ValueFormat

THREE = Subscriber(
    "s", topic="t", value_format=ValueFormat.JSON, parts=3, aggregate_types=frozenset({"order"})
)


def test_a_reset_counts_each_parts_events_from_its_own_checkpoint(
    db: psycopg.Connection[Any], relay_db: psycopg.Connection[Any]
) -> None:
    store = OutboxStore(relay_db)
    store.add(THREE)
    db.execute(  # 40 orders and 10 invoices, which the filter leaves out
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT CASE WHEN n % 5 = 0 THEN 'invoice' ELSE 'order' END, n::text, 'E', '{}' "
        "FROM generate_series(1, 50) AS n"
    )
    rows = db.execute(
        "SELECT transaction_id::text::bigint, position, message_id, aggregate_type,"
        " outbox_part(aggregate_id, 3) FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    # Each part's checkpoint somewhere else (as its relay left it), by the owner.
    for part, at in ((0, 10), (1, 25), (2, 0)):
        key = Position(0, 0) if at == 0 else Position(rows[at - 1][0], rows[at - 1][1])
        db.execute(
            "UPDATE outbox_checkpoints SET transaction_id = %s::text::xid8, position = %s"
            " WHERE subscriber = 's' AND part = %s",
            (key.transaction_id, key.position, part),
        )
    skipped = next(r for r in rows[30:] if r[3] == "order")
    record = Intervention(Action.SKIP, "s", None, Actor(), {}, 1)
    assert store.skip("s", [skipped[2]], record) == []
    target = Position(rows[39][0], rows[39][1])
    checkpoints = {p.part: p.checkpoint for p in store.get("s").parts}

    def expected(part: int) -> int:
        low, high = sorted((checkpoints[part], target))
        return sum(
            1
            for tx, pos, mid, kind, of in rows
            if of == part and kind == "order" and mid != skipped[2] and low < (tx, pos) <= high
        )

    previewed = store.moves(store.get("s"), target)
    assert [(m.part, m.events) for m in previewed] == [(p, expected(p)) for p in range(3)]
    assert all(m.skips for m in previewed)
    moves = store.reset("s", target, Intervention(Action.RESET, "s", None, Actor("me", "here")))
    assert moves == previewed
    assert {p.part: p.checkpoint for p in store.get("s").parts} == dict.fromkeys(range(3), target)
    by_part = {k.part: (k.by_reset, k.by_skip) for k in store.part_skips("s", None)}
    assert by_part == {p: (expected(p), 1 if p == skipped[4] else 0) for p in range(3)}, (
        "the skip stays counted apart"
    )
    [_, reset] = store.ledger("s")
    assert reset.events == sum(expected(p) for p in range(3)) and reset.db_role != "me"
