"""Per-key order is the order Postgres applied the writes (docs/design.md, "Ordering").

The pattern that broke it: each app transaction writes something first (an audit row,
which takes its xid), then locks its aggregate's row, bumps the aggregate's counter and
appends the event. The counter is the database's own order of the aggregate's writes;
the relay's order, ``(transaction_id, position)``, must follow it under every isolation
level. On the schema before migration 0003 the same workload inverts pairs.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from relay import Outbox
from relay.adapters.postgres import migrations
from relay.core.subscribers import ValueFormat
from relay.daemon import Relay
from relay.errors import ConcurrencyError
from tests.support import by_key, consume

HOT_KEYS = 5
WRITERS = 8

APP_TABLES = """
CREATE TABLE audit (id bigserial PRIMARY KEY, note text NOT NULL);
CREATE TABLE orders (id text PRIMARY KEY, counter bigint NOT NULL);
INSERT INTO orders SELECT 'o-' || n, 0 FROM generate_series(1, %s) n;
"""


def _app_transaction(conn: psycopg.Connection[Any], outbox: Outbox, key: str) -> None:
    with conn.transaction():
        conn.execute("INSERT INTO audit (note) VALUES (%s)", (f"touch {key}",))  # xid now
        conn.execute("SELECT counter FROM orders WHERE id = %s FOR UPDATE", (key,))
        (counter,) = conn.execute(  # type: ignore[misc]
            "UPDATE orders SET counter = counter + 1 WHERE id = %s RETURNING counter", (key,)
        ).fetchone()
        outbox.append(
            conn,
            aggregate_type="order",
            aggregate_id=key,
            event_type="OrderCounted",
            payload={"counter": counter},
        )


def _run_writers(url: str, isolation: str, transactions: int) -> int:
    """WRITERS threads commit ``transactions`` app transactions on HOT_KEYS keys;
    returns how many serialization failures were retried."""
    outbox = Outbox(None)
    retried = [0]
    lock = threading.Lock()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"SET default_transaction_isolation = '{isolation}'")
            for _ in range(transactions // WRITERS):
                key = f"o-{rng.randint(1, HOT_KEYS)}"
                while True:
                    try:
                        _app_transaction(conn, outbox, key)
                        break
                    except (
                        pg_errors.SerializationFailure,
                        pg_errors.DeadlockDetected,
                        ConcurrencyError,
                    ):
                        with lock:
                            retried[0] += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return retried[0]


def _inversions(conn: psycopg.Connection[Any]) -> int:
    """Consecutive pairs of one key whose relay order contradicts the counter."""
    rows = conn.execute(
        "SELECT aggregate_id, (payload->>'counter')::bigint FROM outbox"
        " ORDER BY transaction_id, position"
    ).fetchall()
    last: dict[str, int] = {}
    inverted = 0
    for key, counter in rows:
        inverted += counter < last.get(key, 0)
        last[key] = counter
    return inverted


@pytest.fixture
def app_db(database_url: str) -> Callable[[int | None], psycopg.Connection[Any]]:
    conns: list[psycopg.Connection[Any]] = []

    def make(up_to: int | None = None) -> psycopg.Connection[Any]:
        conn = psycopg.connect(database_url, autocommit=True)
        conns.append(conn)
        migrations.migrate(conn, up_to=up_to)
        conn.execute(APP_TABLES % HOT_KEYS)
        return conn

    yield make  # type: ignore[misc]
    for conn in conns:
        conn.close()


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_lock_after_a_first_write_keeps_each_keys_database_order(
    app_db: Callable[[int | None], psycopg.Connection[Any]], database_url: str, isolation: str
) -> None:
    conn = app_db(None)
    _run_writers(database_url, isolation, 400)
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (400,)
    assert _inversions(conn) == 0


def test_the_schema_before_migration_3_inverts_that_pattern(
    app_db: Callable[[int | None], psycopg.Connection[Any]], database_url: str
) -> None:
    """The workload above can fail: on the old schema it does."""
    conn = app_db(2)
    _run_writers(database_url, "read committed", 400)
    assert _inversions(conn) > 0


def test_published_order_follows_the_counter_on_kafka(
    app_db: Callable[[int | None], psycopg.Connection[Any]],
    database_url: str,
    start_relay: Callable[..., Relay],
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    app_db(None)
    subscriber = {
        "name": "s",
        "topic": topic_prefix + "{aggregate_type}",
        "value_format": ValueFormat.JSON.value,
    }
    start_relay(subscribers=[subscriber])
    _run_writers(database_url, "read committed", 1200)
    seen = consume(kafka_bootstrap, [topic_prefix + "order"], 1200, timeout=90)
    assert len(seen) == 1200
    for key, records in by_key(seen).items():
        counters = [json.loads(r.value)["counter"] for r in records]
        assert counters == list(range(1, len(counters) + 1)), key


def test_a_key_ahead_of_every_xid_is_released_by_the_probe_on_an_idle_database(
    db: psycopg.Connection[Any], writer_url: str, relay_url: str
) -> None:
    """A transaction takes its xid; a younger one commits; the first then inserts its
    event. Its key is its snapshot's xmax, the next xid, which nobody holds yet. With no
    other transaction to take it, the commit probe takes one itself, and the row falls
    below the horizon."""
    from relay.adapters.postgres.probe import CommitProbe

    with psycopg.connect(writer_url) as writer:
        writer.execute("SELECT pg_current_xact_id()")
        db.execute("SELECT pg_current_xact_id()")  # younger, and committed (autocommit)
        writer.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('order', 'k', 'OrderPlaced', '{}')"
        )
        writer.commit()
    decided = "SELECT transaction_id < pg_snapshot_xmin(pg_current_snapshot()) FROM outbox"
    assert db.execute(decided).fetchone() == (False,)
    woken = threading.Event()
    probe = CommitProbe(
        lambda: psycopg.connect(relay_url),  # the relay's probe, as the relay role
        "public",
        lambda _types: woken.set(),
        interval=0.01,
        idle_interval=0.01,
    )
    probe.start()
    try:
        for _ in range(500):
            if db.execute(decided).fetchone() == (True,):
                break
            time.sleep(0.01)
    finally:
        probe.stop()
        probe.join(5)
    assert db.execute(decided).fetchone() == (True,)
    assert woken.is_set()


def test_the_probe_survives_a_database_it_cannot_reach_yet(relay_url: str) -> None:
    """Connecting fails with the relay's own error (db.connect wraps psycopg's) while
    Postgres restarts; the probe retries instead of dying, and wakes once it connects."""
    from relay.adapters.postgres import db as relay_db
    from relay.adapters.postgres.probe import CommitProbe
    from relay.errors import DatabaseUnavailable

    attempts: list[int] = []

    def connect() -> psycopg.Connection[Any]:
        attempts.append(1)
        if len(attempts) == 1:
            raise DatabaseUnavailable("postgres is unavailable: restarting")
        return relay_db.connect(relay_url)

    woken = threading.Event()
    probe = CommitProbe(
        connect, "public", lambda _types: woken.set(), interval=0.01, idle_interval=0.01
    )
    probe.start()
    try:
        assert woken.wait(10), "the probe never woke the workers after reconnecting"
        assert probe.is_alive()
    finally:
        probe.stop()
        probe.join(5)
    assert len(attempts) >= 2
