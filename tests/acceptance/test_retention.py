"""Retention: `prune` deletes only rows every subscriber has published."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Event, Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import Position
from relay.core.ports import Selection
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber
from relay.daemon import Relay
from relay.ops.roles import grant_roles
from tests.support import login_url, sub, wait_caught_up, wait_until, write_orders


def test_prune_keeps_unpublished_rows_and_each_streams_latest_version(
    relay_db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    store = OutboxStore(relay_db)
    store.add(Subscriber("fast", topic="fast.{aggregate_type}"))
    store.add(Subscriber("slow", topic="slow.{aggregate_type}"))
    write_orders(writer_db, outbox, [f"o-{i}" for i in range(6)])
    with writer_db.transaction():
        outbox.append_to_stream(
            writer_db, aggregate_type="order", aggregate_id="s-1", expected_version=0,
            events=[Event("OrderShipped", {"order_id": "s-1", "carrier": f"c{i}"}) for i in range(3)],
        )  # fmt: skip
    rows = store.fetch(Position(0, 0), Selection(100)).events
    assert len(rows) == 9
    # "fast" published everything, "slow" only the first four rows.
    for name, upto in (("fast", rows[-1].key), ("slow", rows[3].key)):
        session = store.open_session(name, 1, 60)
        store.claim(name, 0, session)
        store.advance(store.get_part(name, 0), upto, session)

    assert sum(store.prune(older_than_s=0, batch=2)) == 4
    left = store.fetch(Position(0, 0), Selection(100)).events
    assert [r.key for r in left] == [r.key for r in rows[4:]]  # nothing "slow" still needs

    store.advance(store.get_part("slow", 0), rows[-1].key, store.get_part("slow", 0).owner)  # type: ignore[arg-type]
    assert sum(store.prune(older_than_s=0)) == 4
    [kept] = store.fetch(Position(0, 0), Selection(100)).events
    assert (kept.aggregate_id, kept.aggregate_version) == ("s-1", 3)  # the stream's latest
    # ...so event-sourced appends go on after pruning.
    outbox.append_to_stream(
        writer_db, aggregate_type="order", aggregate_id="s-1", expected_version=3,
        events=[Event("OrderShipped", {"order_id": "s-1", "carrier": "late"})],
    )  # fmt: skip


def test_prune_respects_the_minimum_age(
    relay_db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    store = OutboxStore(relay_db)
    store.add(Subscriber("s"))
    write_orders(writer_db, outbox, ["o-1"])
    [row] = store.fetch(Position(0, 0), Selection(10)).events
    session = store.open_session("x", 1, 60)
    store.claim("s", 0, session)
    store.advance(store.get_part("s", 0), row.key, session)
    assert sum(store.prune(older_than_s=3600)) == 0
    assert sum(store.prune(older_than_s=0)) == 1


def test_the_age_is_the_databases_not_the_writers(
    relay_db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]
) -> None:
    """Issue #47: retention read occurred_at, which writers set: a row dated 1970 went
    as soon as it was published, and one dated 2999 never went. Now both keep the
    retention by the time the database recorded them."""
    store = OutboxStore(relay_db)
    store.add(Subscriber("s"))
    for when in ("1970-01-01 00:00+00", "2999-01-01 00:00+00"):
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)"
            " VALUES ('order', 'o', 'OrderPlaced', '{}', %s)",
            (when,),
        )
    rows = store.fetch(Position(0, 0), Selection(10)).events
    session = store.open_session("x", 1, 60)
    store.claim("s", 0, session)
    store.advance(store.get_part("s", 0), rows[-1].key, session)
    assert sum(store.prune(older_than_s=3600)) == 0, "recorded just now"
    assert sum(store.prune(older_than_s=0)) == 2


def test_the_relay_prunes_on_its_own(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)], prune_every=0.5, retention=0)
    write_orders(writer_db, outbox, ["o-1", "o-2"])
    wait_pruned(db)


def wait_pruned(db: psycopg.Connection[Any]) -> None:
    """Until the relay has published the outbox's rows and then pruned them. The
    ceilings are for a loaded machine: publishing the first rows (the topic's creation,
    the producer's start) can take a while; a pass comes every prune_every (0.5 s)."""
    wait_caught_up(db, "s", timeout=120)
    wait_until(
        lambda: db.execute("SELECT count(*) FROM outbox").fetchone() == (0,),
        timeout=60,
        what="the relay to prune its published rows",
    )


# -- as the relay role `outbox-relay grant` makes (no DELETE on the outbox) ---------------


@pytest.fixture
def relay_role(db: psycopg.Connection[Any]) -> Iterator[str]:
    role = f"relay_{uuid.uuid4().hex[:6]}"
    grant_roles(db, "public", relay_role=role, create=True)
    yield role
    name = sql.Identifier(role)
    db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))


def test_the_relay_role_prunes_published_rows_without_delete_on_the_outbox(
    db: psycopg.Connection[Any], outbox: Outbox, database_url: str, relay_role: str
) -> None:
    owner = OutboxStore(db)
    owner.add(Subscriber("s"))
    write_orders(db, outbox, ["o-1", "o-2", "o-3"])
    rows = owner.fetch(Position(0, 0), Selection(10)).events
    session = owner.open_session("x", 1, 60)
    owner.claim("s", 0, session)
    owner.advance(owner.get_part("s", 0), rows[1].key, session)
    with psycopg.connect(login_url(database_url, relay_role), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM outbox")
        assert sum(OutboxStore(conn).prune(older_than_s=0, batch=1)) == 2
    [left] = owner.fetch(Position(0, 0), Selection(10)).events
    assert left.key == rows[2].key  # not yet published: kept


def start_as(
    role_url: str, kafka_bootstrap: str, topic_prefix: str, registry: SchemaFolder
) -> Relay:
    relay = Relay(
        load_settings(
            database_url=role_url,
            bootstrap_servers=kafka_bootstrap,
            subscribers=[sub("s", topic_prefix)],
            poll_interval=0.2,
            heartbeat_interval=0.3,
            session_timeout=3.0,
            metrics_port=0,
            prune_every=0.5,
            retention=0,
        ),
        registry=registry,
    )
    relay.start()
    return relay


def metric(relay: Relay, name: str) -> float:
    assert relay.http is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{relay.http.port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    [value] = [line.split()[1] for line in lines if line.startswith(name + " ")]
    return float(value)


def test_the_relay_prunes_on_its_own_as_the_grant_role_and_counts_it(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
    relay_role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay = start_as(login_url(database_url, relay_role), kafka_bootstrap, topic_prefix, registry)
    try:
        write_orders(db, outbox, ["o-1", "o-2"])
        wait_pruned(db)
        assert metric(relay, "outbox_relay_pruned_events_total") == 2
        assert metric(relay, "outbox_relay_prune_failures_total") == 0
    finally:
        relay.stop()
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def test_a_failed_retention_pass_is_named_and_counted_as_such(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    registry: SchemaFolder,
    relay_role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    db.execute(
        sql.SQL("REVOKE EXECUTE ON FUNCTION outbox_prune(float8, integer) FROM {}").format(
            sql.Identifier(relay_role)
        )
    )
    relay = start_as(login_url(database_url, relay_role), kafka_bootstrap, topic_prefix, registry)
    try:
        wait_until(
            lambda: relay.retention_totals()["failures"] >= 2,
            timeout=120,  # a ceiling for a loaded machine: passes come every 0.5 s
            what="two failed retention passes",
        )
        assert metric(relay, "outbox_relay_prune_failures_total") >= 2
    finally:
        relay.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("retention failed") and "permission denied" in m for m in messages)
    assert not [m for m in messages if "rebalance failed" in m]
