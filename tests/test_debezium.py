"""Debezium Outbox Event Router users switch without changing their apps."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from relay.daemon import Relay
from tests.support import consume, run_cli, sub

REPO = Path(__file__).resolve().parent.parent


def test_rows_written_for_debezium_are_published_like_the_event_router_would(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    db.execute(
        "CREATE TABLE outbox_events (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,"
        " aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)"
    )
    attached = run_cli(
        "debezium", "attach", "public.outbox_events", env={"RELAY_DATABASE_URL": database_url}
    )
    assert attached.returncode == 0, attached.stderr
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])

    ids = [uuid.uuid4() for _ in range(3)]
    with db.transaction():  # what an app written for Debezium does, unchanged
        for i, event_id in enumerate(ids):
            db.execute(
                "INSERT INTO outbox_events VALUES (%s, 'Order', %s, 'OrderCreated', %s)",
                (event_id, f"42{i}", json.dumps({"n": i})),
            )
        db.execute("DELETE FROM outbox_events")  # many apps delete at once
    with db.transaction(force_rollback=True):  # a rolled-back event is never published
        db.execute(
            "INSERT INTO outbox_events VALUES (%s, 'Order', 'x', 'OrderCreated', '{}')",
            (uuid.uuid4(),),
        )
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.Order"], 3)
    assert sorted(r.key for r in seen) == ["420", "421", "422"]
    by_id = {r.headers["id"]: r for r in seen}
    assert set(by_id) == {str(i) for i in ids}
    assert json.loads(by_id[str(ids[1])].value) == {"n": 1}
    assert by_id[str(ids[0])].headers["event_type"] == "OrderCreated"
