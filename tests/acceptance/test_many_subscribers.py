"""Bounded database connections (issue #30): many subscribers on a stock Postgres
(max_connections = 100) leave applications room to connect, and a relay refused
connections backs off, says so once, and never takes the last free slots. Their 120
fixed topics are the operator's, never counted against max_created_topics (issue #47)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Outbox
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon import Relay
from relay.daemon.lifecycle import start_with_retries
from relay.localstack import LocalPostgres, LocalServerError
from relay.ops.roles import grant_roles
from tests.plugins.postgres import _new_local_postgres
from tests.support import ROLE_PASSWORD, as_role, consume, run_cli, wait_until

TYPES = 120
EVENTS_PER_TYPE = 20
BACKENDS_PER_RELAY = 12
RELAY_ROLES = ("relay_a", "relay_b")


def _server(tmp_path_factory: pytest.TempPathFactory, max_connections: int) -> Iterator[str]:
    server, cleanup = _new_local_postgres(
        tmp_path_factory, fsync=False, settings={"max_connections": str(max_connections)}
    )
    try:
        try:
            server.start()
        except LocalServerError as exc:
            pytest.skip(f"cannot start a local PostgreSQL server: {exc}")
        _prepare(server)
        yield server.url
    finally:
        server.stop()
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


def _prepare(server: LocalPostgres) -> None:
    """Migrated; relays and an application each under a role of their own (no
    superusers: they may not use the slots Postgres reserves for superusers)."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        migrations.migrate(conn)
        for role in RELAY_ROLES:
            grant_roles(conn, "public", relay_role=role, create=True)
        conn.execute("CREATE ROLE app LOGIN")
        for role in (*RELAY_ROLES, "app"):
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(ROLE_PASSWORD)
                )
            )


@pytest.fixture
def stock_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Admin URL of a Postgres of the test's own with the stock max_connections (100)."""
    yield from _server(tmp_path_factory, 100)


@pytest.fixture
def small_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Admin URL of a Postgres with max_connections = 20 (17 for non-superusers)."""
    yield from _server(tmp_path_factory, 20)


def _as(url: str, role: str) -> str:
    return as_role(url, role)


def _relay(url: str, role: str, kafka_bootstrap: str, **settings: Any) -> Relay:
    return Relay(
        load_settings(
            database_url=_as(url, role),
            bootstrap_servers=kafka_bootstrap,
            poll_interval=0.5,
            heartbeat_interval=0.5,
            session_timeout=5.0,
            metrics_enabled=False,
            **settings,
        )
    )


class _Application(threading.Thread):
    """An application that connects (as role ``app``) over and over, counting refusals."""

    def __init__(self, url: str) -> None:
        super().__init__(name="application", daemon=True)
        self._url = _as(url, "app")
        self.stopping = threading.Event()
        self.connected = 0
        self.refused: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.connect()

    def connect(self) -> bool:
        try:
            with psycopg.connect(self._url, connect_timeout=10) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError as exc:
            self.refused.append(str(exc))
            return False
        self.connected += 1
        return True


class _Backends(threading.Thread):
    """The most backends each relay role held at once, sampled from pg_stat_activity."""

    def __init__(self, url: str) -> None:
        super().__init__(name="backends", daemon=True)
        self._url = url
        self.stopping = threading.Event()
        self.most: Counter[str] = Counter()

    def run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self.stopping.wait(0.2):
                rows = conn.execute(
                    "SELECT usename, count(*) FROM pg_stat_activity "
                    "WHERE usename = ANY(%s) GROUP BY usename",
                    (list(RELAY_ROLES),),
                ).fetchall()
                for role, count in rows:
                    self.most[role] = max(self.most[role], count)


def _write(url: str) -> list[str]:
    """EVENTS_PER_TYPE events of each aggregate type, a transaction per type."""
    outbox = Outbox(None)
    ids = []
    with psycopg.connect(url, autocommit=True) as conn:
        for t in range(TYPES):
            with conn.transaction():
                for i in range(EVENTS_PER_TYPE):
                    message_id = outbox.append(
                        conn,
                        aggregate_type=f"type{t:03d}",
                        aggregate_id=f"a{i}",
                        event_type="Happened",
                        payload={"type": t, "i": i},
                    )
                    ids.append(str(message_id))
    return ids


@pytest.mark.timeout(900)  # 120 transactional producers start on a shared machine
def test_120_subscribers_on_two_relays_leave_a_stock_postgres_room_for_applications(
    stock_postgres: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    url = stock_postgres
    topics = [f"{topic_prefix}type{t:03d}" for t in range(TYPES)]
    with psycopg.connect(url, autocommit=True) as conn:
        store = OutboxStore(conn)
        for t in range(TYPES):
            store.add(
                Subscriber(
                    f"s{t:03d}",
                    topic=topics[t],
                    value_format=ValueFormat.JSON,
                    aggregate_types=frozenset({f"type{t:03d}"}),
                )
            )
    application, backends = _Application(url), _Backends(url)
    application.start()
    backends.start()
    # A topic per subscriber (no two subscribers may share one), of one partition each.
    # max_created_topics at its default (100): the 120 topics are the operator's, not
    # rows' (issue #47: past the 100th they were refused, 19 parts halted on "poison").
    relays = [_relay(url, role, kafka_bootstrap, topic_partitions=1) for role in RELAY_ROLES]
    try:
        for relay in relays:
            relay.start()
        ids = _write(url)
        seen = consume(kafka_bootstrap, topics, len(ids), timeout=300, quiet=3.0)
    finally:
        for relay in relays:
            relay.stop()
        application.stopping.set()
        backends.stopping.set()
        application.join()
        backends.join()

    published = Counter(r.message_id for r in seen)
    # The figures of issue #30's table (bench/RESULTS.md, "Bounded resources"), shown with -s.
    summary = {
        "subscribers": TYPES,
        "events": len(ids),
        "distinct_published": len(published),
        "most_copies": max(published.values(), default=0),
        "application_connected": application.connected,
        "application_refused": len(application.refused),
        "most_backends_per_relay": dict(backends.most),
    }
    print(json.dumps(summary))
    assert set(published) == set(ids), f"{len(set(ids) - set(published))} events never arrived"
    assert max(published.values()) == 1, "an event was published twice"
    assert application.refused == [], f"the application was refused: {application.refused[:3]}"
    assert application.connected > 0
    for role in RELAY_ROLES:
        assert 0 < backends.most[role] <= BACKENDS_PER_RELAY, backends.most


def test_a_relay_refused_connections_backs_off_says_so_once_a_cause_and_leaves_the_last_slots(
    small_postgres: str, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = small_postgres
    caplog.set_level(logging.INFO, logger="relay.adapters.postgres.pool")
    application = _Application(url)
    # Every slot a non-superuser may use (20 - 3 reserved), taken by the application.
    held = []
    while application.connect():
        held.append(psycopg.connect(_as(url, "app")))
    relay = _relay(url, RELAY_ROLES[0], kafka_bootstrap)
    starter = threading.Thread(target=start_with_retries, args=(relay,), daemon=True)
    starter.start()
    try:
        wait_until(lambda: _refusals(caplog) > 0, timeout=30, what="the refusal logged")
        # Room for the application, but less than the relay leaves free (5): it stays out.
        for conn in held[:3]:
            conn.close()
        time.sleep(5)  # the relay retries meanwhile (backoff 1 s, 2 s...)
        assert application.connect(), application.refused
        assert relay.membership.session is None, "the relay started on the last free slots"
        for conn in held[3:]:
            conn.close()
        wait_until(
            lambda: relay.membership.session is not None, timeout=60, what="the relay started"
        )
    finally:
        for conn in held:
            conn.close()
        relay.request_stop()
        starter.join(60)
        relay.stop()
    # Told once per cause (issue #49): Postgres' own refusal while every slot was taken,
    # then the relay's keep_free_connections while only 3 were free; never per retry.
    told = [r.getMessage() for r in caplog.records if _refusal(r)]
    assert len(told) == 2, [r.getMessage() for r in caplog.records]
    assert "slots are reserved" in told[0] and "keep_free_connections" in told[1], told
    assert any("accepts this relay's connections again" in r.getMessage() for r in caplog.records)


def _refusals(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if _refusal(r))


def _refusal(record: logging.LogRecord) -> bool:
    return (
        record.name == "relay.adapters.postgres.pool"
        and "refuses this relay a connection" in record.getMessage()
    )


def test_grant_caps_the_relay_role_connections(stock_postgres: str) -> None:
    granted = run_cli(
        "grant", "--relay-role", "relay_a", "--connection-limit", "12",
        "--database-url", stock_postgres,
    )  # fmt: skip
    assert granted.returncode == 0, granted.stderr
    assert "connection limit 12 to relay_a" in granted.stdout
    with psycopg.connect(stock_postgres, autocommit=True) as conn:
        limit = conn.execute(
            "SELECT rolconnlimit FROM pg_roles WHERE rolname = 'relay_a'"
        ).fetchone()
    assert limit == (12,)
    refused = run_cli(
        "grant", "--writer-role", "app", "--connection-limit", "12",
        "--database-url", stock_postgres,
    )  # fmt: skip
    assert refused.returncode != 0 and "--relay-role" in refused.stderr
