"""The columns each fetch returns are those its plan reads (Postgres): the fetches read
their rows by position, for speed, so the names and order the SQL gives them are checked
here, once, rather than per row (relay/adapters/postgres/fetch_plan.py)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import fetch_plan
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import OutboxEvent, Position, Unreadable
from relay.core.ports import Selection
from relay.observability.latency import ages_of


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


def test_payloads_passed_through_are_jsonb_text_as_postgres_writes_it(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]
) -> None:
    """Issue #53's trade-offs, as Postgres makes them: jsonb's text is spaced and its keys
    in jsonb's order, its numbers exact (numeric's text, never a double's), its UTF-8 raw;
    a row Python may not load is loaded (so poison stays poison)."""
    written = [
        '{"b": [1,2], "a": 1}',
        '{"n": 1.50, "m": 1E2, "f": 1e-7, "s": "caf\\u00e9 \\/"}',
        '{"n": 12345678901234567890123}',
        '{"n": 1e5000}',
    ]
    for n, text in enumerate(written):
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('order', %s, 'Note', %s::jsonb)",
            (str(n), text),
        )
    store = OutboxStore(db)
    raw = store.fetch(Position(0, 0), Selection(10, raw_payloads=True)).events
    loaded = store.fetch(Position(0, 0), Selection(10)).events
    assert [e.payload for e in raw[:2]] == [
        b'{"a": 1, "b": [1, 2]}',
        '{"f": 0.0000001, "m": 100, "n": 1.50, "s": "café /"}'.encode(),
    ]
    assert [e.payload for e in loaded[:2]] == [json.loads(p) for p in written[:2]]
    assert raw[2].payload == b'{"n": 12345678901234567890123}'
    assert loaded[2].payload == {"n": 12345678901234567890123}
    assert isinstance(raw[3].payload, Unreadable) and "digits" in str(raw[3].payload)


def test_an_events_id_and_commit_time_read_as_written_in_any_session_time_zone(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]
) -> None:
    """The fetch keeps the message id and occurred_at as Postgres sends them (issue #53):
    read through their names they are the UUID and the moment written, in UTC whatever
    the session's TimeZone; a time before 2000 counts back; 'infinity' is clamped."""
    written = [
        (uuid.uuid4(), "2026-12-04 20:31:07.123456+01"),
        (uuid.uuid4(), "1999-12-31 23:59:59.999999+00"),
        (uuid.uuid4(), "infinity"),
    ]
    for message_id, at in written:
        writer_db.execute(
            "INSERT INTO outbox (message_id, aggregate_type, aggregate_id, event_type,"
            " payload, occurred_at) VALUES (%s, 'order', 'k', 'Note', '{}', %s)",
            (message_id, at),
        )
    db.execute("SET TimeZone = 'America/New_York'")
    events = OutboxStore(db).fetch(Position(0, 0), Selection(10)).events
    assert [e.message_id for e in events] == [m for m, _ in written]
    assert [e.occurred_at for e in events] == [
        datetime(2026, 12, 4, 19, 31, 7, 123456, tzinfo=UTC),
        datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(9999, 12, 30, tzinfo=UTC),
    ]
    assert all(e.occurred_at.utcoffset() == timedelta(0) for e in events)
    assert events[0].occurred_at.isoformat() == "2026-12-04T19:31:07.123456+00:00"
    # The latency histogram reads the commit times as fetched, as it reads them typed.
    now = datetime(2027, 1, 1, tzinfo=UTC)
    typed = [OutboxEvent(*e[:2], e.message_id, *e[3:9], e.occurred_at, *e[10:]) for e in events]
    assert ages_of(events, now) == ages_of(typed, now)
    since = now - datetime(2026, 12, 4, 19, 31, 7, 123456, tzinfo=UTC)
    assert ages_of(events, now)[0] == since // timedelta(microseconds=1)
    assert ages_of(events, now)[2] == 0
