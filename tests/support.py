"""Test helpers: a real read_committed consumer, and the relay run in-process."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import Outbox
from relay.adapters.kafka.publishers import PublisherFactory
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.core.model import ConsumedRecord, PartId
from relay.daemon import Relay
from relay.engine.worker import PartWorker
from relay.errors import RelayError
from relay.localstack import LocalPostgres
from relay.localstack.postgres import find_pg_binary
from relay.localstack.process import LocalServer
from relay.ops.roles import grant_roles

_WARMUP_S = 2.5


def wait_for_topics(bootstrap: str, topics: list[str], timeout: float = 30.0) -> dict[str, int]:
    """Partition count of each topic, once all exist."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        metadata = admin.list_topics(timeout=5).topics
        if all(t in metadata and metadata[t].partitions for t in topics):
            return {t: len(metadata[t].partitions) for t in topics}
        if time.monotonic() > deadline:
            missing = [t for t in topics if t not in metadata]
            raise AssertionError(f"topics never appeared: {missing}")
        time.sleep(0.1)


def consume(
    bootstrap: str,
    topics: list[str],
    expected: int,
    *,
    timeout: float = 30.0,
    quiet: float = 1.0,
    isolation: str = "read_committed",
) -> list[ConsumedRecord]:
    """Read every partition of ``topics`` from the start, read_committed, until ``expected``
    records arrived and nothing more came for ``quiet`` seconds (so duplicates show up)."""
    wait_for_topics(bootstrap, topics, timeout)
    config = {"bootstrap.servers": bootstrap}
    reader = KafkaTopicReader(config, group="outbox-relay-tests", isolation=isolation)
    seen: list[ConsumedRecord] = []
    started = time.monotonic()
    deadline = started + timeout
    last_arrival = started
    with closing(reader.follow(topics)) as records:
        for record in records:
            now = time.monotonic()
            if record is not None:
                seen.append(record)
                last_arrival = now
            elif len(seen) >= expected and now - last_arrival >= quiet:
                break
            if now >= deadline:
                break
    return seen


def nothing_arrives(bootstrap: str, topics: list[str], within: float) -> list[ConsumedRecord]:
    """Every record on ``topics`` once ``within`` seconds have passed (expect []).

    Which topics exist is asked after the wait, not before: a relay creates a topic when
    it first publishes to it, so a topic missing at the start may hold records by the end.
    """
    time.sleep(within)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = [t for t in topics if t in admin.list_topics(timeout=5).topics]
    if not existing:
        return []
    return consume(bootstrap, existing, expected=0, timeout=20, quiet=1.0)


def by_key(seen: list[ConsumedRecord]) -> dict[str, list[ConsumedRecord]]:
    """Records grouped by key (as text), each group in the order a consumer of the
    partition sees them."""
    groups: dict[str, list[ConsumedRecord]] = {}
    for record in sorted(seen, key=lambda s: (s.topic, s.partition, s.offset)):
        groups.setdefault((record.key or b"").decode(), []).append(record)
    return groups


class LoopThreads:
    """``count`` daemon threads, each running ``_run(its index)`` until :meth:`stop`
    (writers of a chaos test, say): ``_stop`` says when, ``_lock`` guards shared counts."""

    def __init__(self, count: int) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)
        ]

    def _run(self, index: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:  # started: a test that failed early stops too
                thread.join(30)


class WriterLoops(LoopThreads):
    """Threads that each run ``_transaction`` again and again on a connection of their
    own to ``url``, a random pause of up to ``pause`` seconds apart, and reconnect after
    an error (a Postgres restart, a failover), which ``_failed`` counts."""

    def __init__(self, url: str, count: int, *, autocommit: bool, pause: float) -> None:
        super().__init__(count)
        self._url = url
        self._autocommit = autocommit
        self._pause = pause

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        raise NotImplementedError

    def _failed(self) -> None:
        raise NotImplementedError

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.is_set():
            try:
                conn = conn or psycopg.connect(
                    self._url, autocommit=self._autocommit, connect_timeout=3
                )
                self._transaction(conn, rng)
            except (psycopg.Error, RelayError):
                with self._lock:
                    self._failed()
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(10 * self._pause)  # the server is away: no busy loop
            time.sleep(rng.uniform(0, self._pause))
        if conn is not None:
            conn.close()


def fenced_blocks(document: Path, language: str) -> list[str]:
    """The bodies of ``document``'s fenced code blocks in ``language`` (```language)."""
    text = document.read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


# -- the roles production runs as (tests/README.md, "Roles") -------------------------

# Cluster-wide names, created on a server the first time a test grants them (roles
# outlive the per-test databases; grants die with them). Every server checks the
# password (the local one too: issue #47), so each role gets this one.
RELAY_ROLE = "outbox_test_relay"
WRITER_ROLE = "outbox_test_writer"
STRANGER_ROLE = "outbox_test_stranger"
SECOND_WRITER_ROLE = "outbox_test_writer_b"  # another application's writer role
ROLE_PASSWORD = "outbox-test-role"


def as_role(url: str, role: str, password: str | None = ROLE_PASSWORD) -> str:
    """``url`` (a URL or key=value conninfo) logging in as ``role`` instead."""
    if not url.startswith(("postgresql://", "postgres://")):
        return make_conninfo(url, user=role, password=password)
    parts = urlsplit(url)
    login = quote(role, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{login}@{parts.hostname}:{parts.port}"))


def login_url(owner_url: str, role: str) -> str:
    """``role``'s URL on the database at ``owner_url``, once the owner has given it the
    test password: a role `outbox-relay grant --create` makes has none, and the servers
    check one."""
    with psycopg.connect(owner_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(ROLE_PASSWORD)
            )
        )
    return as_role(owner_url, role)


@dataclass(frozen=True)
class Roles:
    """URLs of one database as each of the roles production uses."""

    owner_url: str
    relay_url: str  # `outbox-relay grant --relay-role`: the relay, status, verify
    writer_url: str  # `--writer-role`: the applications that write events
    stranger_url: str  # a login with no grant at all (injection, refusals)


def create_test_roles(server_url: str) -> None:
    """Create the test roles on the server at ``server_url`` (any database of it), as
    an operator does on a new cluster before restoring a dump that grants them."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        for role in (RELAY_ROLE, WRITER_ROLE, STRANGER_ROLE):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                continue
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(ROLE_PASSWORD)
                )
            )


def grant_test_roles(
    owner_url: str, schema: str = "public", *, read_all_stats: bool = False
) -> Roles:
    """Grant the test roles on the migrated database at ``owner_url``, as `outbox-relay
    grant --create [--read-all-stats]` does (creating the roles if this server has none
    yet). Role memberships are cluster-wide: ``read_all_stats`` holds until the next
    grant without it, which every test's ``roles`` fixture makes."""
    with psycopg.connect(owner_url, autocommit=True) as conn:
        grant_roles(
            conn,
            schema,
            relay_role=RELAY_ROLE,
            writer_role=WRITER_ROLE,
            create=True,
            read_all_stats=read_all_stats,
        )
        exists = "SELECT 1 FROM pg_roles WHERE rolname = %s"
        if conn.execute(exists, (STRANGER_ROLE,)).fetchone() is None:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(STRANGER_ROLE)))
        for role in (RELAY_ROLE, WRITER_ROLE, STRANGER_ROLE):
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(ROLE_PASSWORD)
                )
            )
    return Roles(
        owner_url=owner_url,
        relay_url=as_role(owner_url, RELAY_ROLE),
        writer_url=as_role(owner_url, WRITER_ROLE),
        stranger_url=as_role(owner_url, STRANGER_ROLE),
    )


def grant_writer(owner_url: str, role: str, schema: str = "public") -> str:
    """``role`` granted as `outbox-relay grant --create --writer-role ROLE` does, with the
    test password; returns the database's URL as that role."""
    with psycopg.connect(owner_url, autocommit=True) as conn:
        grant_roles(conn, schema, writer_role=role, create=True)
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(ROLE_PASSWORD)
            )
        )
    return as_role(owner_url, role)


# -- writing demo events -----------------------------------------------------------


def order(i: int | str) -> dict[str, Any]:
    return {"order_id": str(i), "customer_id": "c", "amount_cents": len(str(i))}


def sub(name: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "topic": prefix + "outbox.event.{aggregate_type}", **extra}


def write_orders(
    conn: psycopg.Connection[Any], outbox: Outbox, ids: list[str], key: str | None = None
) -> None:
    for i in ids:
        outbox.append(
            conn,
            aggregate_type="order",
            aggregate_id=key or i,
            event_type="OrderPlaced",
            payload=order(i),
        )


def keys(seen: list[ConsumedRecord]) -> list[str]:
    """The records' keys, as text, sorted."""
    return sorted((r.key or b"").decode() for r in seen)


def keyed(seen: list[ConsumedRecord]) -> dict[str, ConsumedRecord]:
    """The records by key, as text (the last one of a key)."""
    return {(r.key or b"").decode(): r for r in seen}


def ids_of(seen: list[ConsumedRecord]) -> list[str]:
    return [s.message_id or "" for s in seen]


# -- the relay, from outside ----------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def local_workdir(prefix: str, name: str) -> Iterator[Path]:
    """A fresh folder ``name`` for the local stack's servers, removed after. Not pytest's
    tmp_path: as root, Postgres runs as the ``postgres`` user, which cannot enter
    pytest's 0700 temp tree."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    try:
        yield base / name
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``outbox-relay ARGS`` in a subprocess; its exit code is part of what tests check.
    Its stdin is no terminal (as in CI, whoever runs the tests): a command that would ask
    for confirmation refuses instead."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        check=False,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def part_status(url: str, part: PartId) -> dict[str, Any]:
    """``part`` as `outbox-relay status --json` shows it, run as ``url``'s role."""
    done = run_cli("status", "--json", env={"RELAY_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    [line] = [p for p in json.loads(done.stdout)["parts"] if p["part"] == str(part)]
    return dict(line)


def caught_up(db: psycopg.Connection[Any], name: str) -> bool:
    """Every event of subscriber ``name`` is published (its lag is 0)."""
    from relay.adapters.postgres.store import OutboxStore
    from relay.ops.lag import subscriber_lag

    store = OutboxStore(db)
    return subscriber_lag(store, store.get(name)).events == 0


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    """Until ``condition()`` holds; ``timeout`` is only a ceiling, generous for a loaded
    machine (relays do the work waited for), never a measured duration."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def wait_caught_up(db: psycopg.Connection[Any], name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not caught_up(db, name):
        assert time.monotonic() < deadline, f"subscriber {name} never caught up"
        time.sleep(0.05)


def worker(relay: Relay, subscriber: str, part: int = 0) -> PartWorker:
    """The relay's running worker of part ``subscriber``/``part``."""
    return relay.workers[PartId(subscriber, part)]


def session_id(relay: Relay) -> str | None:
    """The id of the session ``relay`` holds (None: it holds none, so no part)."""
    session = relay.membership.session
    return None if session is None else str(session.id)


def restart(server: LocalServer) -> None:
    """Stop a local server, then start it again on the same port and data directory."""
    server.stop()
    server.start()


def streaming_standby(primary: LocalPostgres, log_path: Path) -> LocalPostgres:
    """A started hot standby of ``primary`` from pg_basebackup, streaming over loopback
    (asynchronously unless the primary names it in synchronous_standby_names). Its data
    directory is the caller's to delete once it is stopped."""
    data_dir = Path(primary.data_dir).parent / f"standby-{uuid.uuid4().hex[:6]}"
    subprocess.run(
        [
            find_pg_binary("pg_basebackup"),
            # The URL names the primary's password file; -R hands it on to the standby.
            *("-d", primary.url),
            *("-D", str(data_dir), "-R", "-X", "stream", "--no-sync", "--checkpoint=fast"),
        ],
        check=True,
    )
    standby = LocalPostgres(data_dir, fsync=False, log_path=log_path)
    standby.start()
    return standby


def outbox_rows_read(db: psycopg.Connection[Any], query: bytes, params: Any = None) -> int:
    """Rows of the outbox table ``query`` reads (EXPLAIN ANALYZE, sub-plans included),
    whether it keeps them or filters them out."""
    explain = b"EXPLAIN (ANALYZE, FORMAT JSON) " + query
    [[plan]] = db.execute(explain, params, prepare=False).fetchone() or [[{}]]

    def scans(node: dict[str, Any]) -> Any:
        if node.get("Relation Name") == "outbox":
            yield node["Actual Rows"] * node.get("Actual Loops", 1)
            yield node.get("Rows Removed by Filter", 0)
        for child in node.get("Plans", []):
            yield from scans(child)

    return sum(scans(plan["Plan"]))


def http_get(url: str, timeout: float = 15.0) -> tuple[int, str]:
    """Status and body of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def unstarted_publishers(relay: Relay, conn: psycopg.Connection[Any]) -> PublisherFactory:
    """The publishers of a relay that is not started (it has no pool), for tests that
    play a relay's part: their record of topics borrows ``conn`` (autocommit)."""
    record = PostgresTopicRecord(lambda: nullcontext(conn), relay.settings.database_schema)
    return PublisherFactory(relay.settings, relay.topic_guard, record)


@contextmanager
def without_cyclic_collector() -> Iterator[None]:
    """Within, only reference counting frees objects, as in a relay between its rare
    cyclic collections (``tune_gc``): what a reference cycle keeps stays alive."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
