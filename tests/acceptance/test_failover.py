"""A Postgres failover under running relays (issue #49): a primary with a synchronous
streaming standby, two relay processes and writers on a multi-host URL with
``target_session_attrs=read-write``, the primary killed with ``kill -9`` (its whole
process group, as a lost host) mid-run and the standby promoted with ``pg_ctl promote``.

What must hold, read from the new primary and from Kafka: every event in the new
primary's outbox is on Kafka exactly once (read_committed), every commit a writer saw
acknowledged is in that outbox, none a writer saw fail before its COMMIT is, `outbox-relay
verify` is clean, and the relays went on by themselves (the same processes, no
restart). A COMMIT whose reply was lost with the primary may or may not be in: the new
primary's outbox says which, and whichever it is, Kafka must agree.

Run alone with ``pytest tests/acceptance/test_failover.py -s`` to see the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import ConsumedRecord
from relay.core.subscribers import Subscriber, ValueFormat
from relay.errors import RelayError
from relay.localstack import LocalPostgres
from relay.localstack.postgres import find_pg_binary
from tests.support import (
    RELAY_ROLE,
    REPO,
    ROLE_PASSWORD,
    WRITER_ROLE,
    WriterLoops,
    caught_up,
    consume,
    grant_test_roles,
    order,
    run_cli,
    streaming_standby,
    wait_until,
)

pytestmark = pytest.mark.chaos

KEYS = [f"k{i}" for i in range(20)]
WRITERS = 3
BEFORE_KILL_S = 5.0  # writers and relays at work on the primary
LAG_S = 0.5  # how far the standby is behind when the primary dies
DETECTION_S = 1.0  # the kill, then as long until the standby is promoted
AFTER_PROMOTION_S = 5.0  # writers at work on the new primary
_SECTION = "### Postgres failover"


@dataclass
class Outcomes:
    """What the writers know of their transactions' fate, by message id."""

    acknowledged: set[str] = field(default_factory=set)  # COMMIT answered
    unknown: set[str] = field(default_factory=set)  # COMMIT sent, its reply lost
    not_committed: set[str] = field(default_factory=set)  # failed before COMMIT was sent
    errors: int = 0


class Writers(WriterLoops):
    """Transactions of 1-5 events as the writer role, each COMMIT issued on its own, so
    that a failure before it (rolled back) is told from one at it (outcome unknown)."""

    def __init__(self, url: str, outbox: Outbox) -> None:
        super().__init__(url, WRITERS, autocommit=False, pause=0.01)
        self._outbox = outbox
        self.outcomes = Outcomes()

    def write_one(self) -> None:
        with psycopg.connect(self._url) as conn:
            self._transaction(conn, random.Random())

    def _failed(self) -> None:  # the failover: reconnect
        self.outcomes.errors += 1

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        ids: list[str] = []
        try:
            for _ in range(rng.randint(1, 5)):
                key = rng.choice(KEYS)
                ids.append(str(self._write(conn, key, rng)))
        except (psycopg.Error, RelayError):
            self._record(self.outcomes.not_committed, ids)
            raise
        try:
            conn.commit()
        except psycopg.Error:
            self._record(self.outcomes.unknown, ids)
            raise
        self._record(self.outcomes.acknowledged, ids)

    def _write(self, conn: psycopg.Connection[Any], key: str, rng: random.Random) -> Any:
        return self._outbox.append(
            conn,
            aggregate_type="order",
            aggregate_id=key,
            event_type="OrderPlaced",
            payload=order(f"{key}-{rng.randrange(10**9)}"),
        )

    def _record(self, into: set[str], ids: list[str]) -> None:
        with self._lock:
            into.update(ids)


class Relays:
    """``outbox-relay run`` processes, each logging to its own file."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self._env = {**os.environ, **env}
        self._logs = logs
        self.procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, count: int) -> None:
        for n in range(count):
            log = (self._logs / f"relay-{n}.log").open("wb")
            command = [sys.executable, "-m", "relay", "run"]
            proc = subprocess.Popen(
                command, env=self._env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
            self.procs.append((proc, log))

    def alive(self) -> int:
        return sum(proc.poll() is None for proc, _ in self.procs)

    def text(self) -> str:
        return "".join(Path(log.name).read_text(errors="replace") for _, log in self.procs)

    def stop(self) -> list[int | None]:
        """SIGTERM every relay; their exit codes (None: killed, it did not stop)."""
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc, log in self.procs:
            try:
                codes.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
            log.close()
        return codes


def multi_host_url(role: str, *servers: LocalPostgres) -> str:
    """The outbox database on every one of ``servers`` as ``role``, connecting to
    whichever takes writes, as deploy/README.md's "Postgres failover" says."""
    hosts = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    return (
        f"postgresql://{role}:{ROLE_PASSWORD}@{hosts}/outbox"
        "?target_session_attrs=read-write&connect_timeout=3"
    )


def failover_sql() -> str:
    """The SQL block of deploy/README.md's "Postgres failover", run as written."""
    text = (REPO / "deploy" / "README.md").read_text()
    return text[text.index(_SECTION) :].split("```sql\n", 1)[1].split("```", 1)[0]


def outbox_database(primary: LocalPostgres, topic_prefix: str) -> str:
    """The migrated outbox on ``primary`` with one 4-part subscriber, as its owner."""
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE outbox")
    url = primary.url_for("outbox")
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
        subscriber = Subscriber(
            "orders", topic=topic_prefix + "failover.{aggregate_type}", parts=4,
            value_format=ValueFormat.JSON,
        )  # fmt: skip
        OutboxStore(conn).add(subscriber)
    grant_test_roles(url)
    return url


def make_synchronous(primary: LocalPostgres) -> None:
    """The standby made synchronous by the README's settings; until it says so."""
    with psycopg.connect(primary.url, autocommit=True) as conn:
        for statement in filter(str.strip, failover_sql().split(";")):
            conn.execute(statement)

        def synchronous() -> bool:
            row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
            return row is not None and row[0] == "sync"

        wait_until(synchronous, timeout=30, what="a synchronous standby")


@contextmanager
def standby_of(primary: LocalPostgres, tmp_path: Path) -> Iterator[LocalPostgres]:
    standby = streaming_standby(primary, tmp_path / "standby.log")
    try:
        yield standby
    finally:
        standby.stop()
        shutil.rmtree(standby.data_dir, ignore_errors=True)


def warm_up(owner_url: str, writers: Writers) -> None:
    """Until both relays own parts and have published a first event: the kill is to
    land on relays at work, not on relays still starting (a fresh broker's transaction
    coordinator takes seconds to load)."""
    writers.write_one()
    with psycopg.connect(owner_url, autocommit=True) as conn:
        owners = "SELECT count(DISTINCT owner) FROM outbox_checkpoints"

        def at_work() -> bool:
            return caught_up(conn, "orders") and conn.execute(owners).fetchone() == (2,)

        wait_until(at_work, timeout=300, what="both relays at work")


def lagging(primary: LocalPostgres) -> int:
    """The primary's WAL sender frozen (SIGSTOP), for good: the standby falls behind, as
    over a slow link, and what it was not sent dies with the primary (WAL already sent
    but not yet read would still reach the standby from its socket). A synchronous
    standby makes commits wait meanwhile; an asynchronous one lets them return. Returns
    the sender's pid."""
    with psycopg.connect(primary.url, autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_replication").fetchone()
    assert row is not None, "the standby streams"
    os.kill(row[0], signal.SIGSTOP)
    return int(row[0])


def kill_host(server: LocalPostgres, frozen: int) -> None:
    """``kill -9`` of the postmaster and every backend (its own process group): no
    shutdown checkpoint, no goodbye to clients or to the standby. The frozen WAL sender
    too: a backend runs in a session of its own, and a stopped one never notices that
    its postmaster died (it would outlive the test)."""
    assert server.pid is not None
    os.killpg(server.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(frozen, signal.SIGKILL)
    wait_until(lambda: not server.running, timeout=10, what="the primary to die")


def promote(standby: LocalPostgres) -> None:
    """``pg_ctl promote``, as the server's own user (root may not run it)."""
    user = "postgres" if os.geteuid() == 0 else None
    pg_ctl = find_pg_binary("pg_ctl")
    command = [pg_ctl, "promote", "-w", "-D", str(standby.data_dir)]
    subprocess.run(command, check=True, user=user, capture_output=True, timeout=60)


def outbox_ids(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id::text FROM outbox").fetchall()
    return {row[0] for row in rows}


def relay_env(relay_url: str, bootstrap: str) -> dict[str, str]:
    return {
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": bootstrap,
        "RELAY_SESSION_TIMEOUT": "3",
        "RELAY_HEARTBEAT_INTERVAL": "0.5",
        "RELAY_POLL_INTERVAL": "0.2",
        "RELAY_BATCH_SIZE": "100",
        "RELAY_SHUTDOWN_TIMEOUT": "10",
        "RELAY_METRICS_PORT": "0",  # two relays on one host: any free port
    }


def assert_verify_clean(relay_url: str, bootstrap: str, rows: int) -> None:
    """`outbox-relay verify` on the multi-host URL, as the relay role."""
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": bootstrap}
    result = run_cli("verify", "--json", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    [report] = json.loads(result.stdout)
    assert report["clean"] and report["pending"] == 0, report
    assert (report["found"], report["ahead"], report["not_in_outbox"]) == (rows, 0, 0), report


def stall(seen: list[ConsumedRecord], killed_at: float) -> dict[str, float]:
    """From the kill, by the records' own timestamps (set by the relays' producers): when
    the first record was produced, and when every key had one again (each part, so,
    published again)."""
    first: dict[bytes | None, float] = {}
    for record in seen:
        stamp = (record.timestamp_ms or 0) / 1000 - killed_at
        if stamp > 0:
            first[record.key] = min(stamp, first.get(record.key, stamp))
    assert first and len(first) == len({r.key for r in seen}), "a key without records after"
    return {"first_record_s": min(first.values()), "every_key_s": max(first.values())}


_LINES = {
    "refused": re.compile(r"Postgres refuses this relay a connection \(.*?\)"),
    "accepted": re.compile(r"Postgres accepts this relay's connections again"),
    "adopted": re.compile(r"committed without its checkpoint update; adopting"),
    "not_adopted": re.compile(r"but it is not adopted"),
}


def log_counts(text: str) -> dict[str, int]:
    return {name: len(pattern.findall(text)) for name, pattern in _LINES.items()}


@pytest.mark.timeout(900)  # a fresh broker and two clusters, on a busy machine
def test_relays_follow_a_failover_to_a_synchronous_standby_without_loss_or_duplicates(
    new_cluster: Any, kafka_bootstrap: str, topic_prefix: str, outbox: Outbox, tmp_path: Path
) -> None:
    primary = new_cluster()
    owner_url = outbox_database(primary, topic_prefix)
    with standby_of(primary, tmp_path) as standby:
        make_synchronous(primary)
        relay_url = multi_host_url(RELAY_ROLE, primary, standby)
        relays = Relays(relay_env(relay_url, kafka_bootstrap), tmp_path)
        writers = Writers(multi_host_url(WRITER_ROLE, primary, standby), outbox)
        new_primary = standby.url_for("outbox")
        try:
            relays.start(2)
            warm_up(owner_url, writers)
            writers.start()
            time.sleep(BEFORE_KILL_S)
            sender = lagging(primary)
            time.sleep(LAG_S)
            killed_at = time.time()
            kill_host(primary, sender)
            time.sleep(DETECTION_S)
            promote(standby)
            promoted_at = time.time()
            time.sleep(AFTER_PROMOTION_S)
            writers.stop()
            with psycopg.connect(new_primary, autocommit=True) as conn:
                wait_until(lambda: caught_up(conn, "orders"), timeout=120, what="catch-up")
            alive_after = relays.alive()
        finally:
            writers.stop()
            codes = relays.stop()
        rows = outbox_ids(new_primary)
        assert_verify_clean(relay_url, kafka_bootstrap, len(rows))

    outcomes = writers.outcomes
    seen = consume(kafka_bootstrap, [topic_prefix + "failover.order"], len(rows), timeout=60)
    published = [r.message_id for r in seen]
    waited = stall(seen, killed_at)
    figures = {
        "outbox_rows": len(rows),
        "records": len(published),
        "acknowledged": len(outcomes.acknowledged),
        "unknown_outcome": len(outcomes.unknown),
        "unknown_outcome_committed": len(outcomes.unknown & rows),
        "failed_before_commit": len(outcomes.not_committed),
        "writer_errors": outcomes.errors,
        "promoted_after_kill_s": round(promoted_at - killed_at, 2),
        "after_kill": {name: round(seconds, 2) for name, seconds in waited.items()},
        "relay_lines": log_counts(relays.text()),
        "logs": str(tmp_path),
    }
    print(json.dumps(figures, indent=2))
    assert alive_after == 2 and codes == [0, 0], f"relays alive {alive_after}, exits {codes}"
    assert outcomes.acknowledged - rows == set(), "acknowledged commits lost in the failover"
    assert outcomes.not_committed & rows == set(), "events of failed transactions are in"
    assert rows - outcomes.acknowledged - outcomes.unknown == set(), "rows nobody wrote"
    assert len(published) == len(set(published)), "published twice"
    assert set(published) == rows, "Kafka and the new primary's outbox differ"
