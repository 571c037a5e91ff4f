"""``outbox-relay run --workers N``: one relay publishing from N member processes.

The members share the parts as peers do (a session each), and the relay answers for all
of them: one /metrics, one /readyz, one exit code. Killed members come back; a fatal
error in one stops the relay.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from relay import Outbox
from tests.support import consume, http_get, order, run_cli, wait_caught_up, wait_until

REPO = Path(__file__).resolve().parents[2]
KEYS, PER_KEY, PARTS = 20, 25, 4
_SERVING = re.compile(r"serving /metrics, /healthz and /readyz on [^:]+:(\d+)")


class RunningRelay:
    """``outbox-relay run`` as a subprocess, logging to a file."""

    def __init__(self, log: IO[bytes], proc: subprocess.Popen[bytes]) -> None:
        self.log, self.proc = log, proc

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def port(self) -> int:
        wait_until(lambda: _SERVING.search(self.output()) is not None, what="the HTTP port")
        found = _SERVING.search(self.output())
        assert found is not None
        return int(found.group(1))

    def get(self, path: str) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.port()}{path}")

    def children(self) -> list[int]:
        """Pids of the member processes (spawned children of the relay's process)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = stat[stat.rindex(")") + 2 :].split()[1]
            if ppid == str(self.proc.pid) and b"spawn_main" in cmdline:
                found.append(int(entry.name))
        return found


@pytest.fixture
def run_relay(
    tmp_path: Path, kafka_bootstrap: str, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """``outbox-relay run ARGS`` as the relay role (on the migrated, granted database),
    unless the test names another RELAY_DATABASE_URL."""
    started: list[RunningRelay] = []

    def start(*args: str, **env: str) -> RunningRelay:
        log = (tmp_path / f"relay-{len(started)}.log").open("wb")
        if "RELAY_DATABASE_URL" not in env:
            env["RELAY_DATABASE_URL"] = request.getfixturevalue("relay_url")
        full_env = {**os.environ,
                    "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap, "RELAY_METRICS_PORT": "0",
                    "RELAY_HEARTBEAT_INTERVAL": "0.5", "RELAY_SESSION_TIMEOUT": "3", **env}  # fmt: skip
        # Its own process group, which its members join: teardown kills them all.
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "run", *args],
            cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        started.append(RunningRelay(log, proc))
        return started[-1]

    yield start
    for relay in started:
        # Whatever the test's outcome: a member left behind (its supervisor killed, say)
        # would otherwise go on retrying the database for ever.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(relay.proc.pid, signal.SIGKILL)
        relay.proc.wait()
        relay.log.close()


def write(writer_url: str, outbox: Outbox, rounds: range) -> None:
    """PER_KEY events per key in all; each transaction appends one event to every key."""
    with psycopg.connect(writer_url) as conn:
        for n in rounds:
            with conn.transaction():
                for k in range(KEYS):
                    outbox.append(conn, aggregate_type="order", aggregate_id=f"k{k}",
                                  event_type="OrderPlaced", payload=order(n))  # fmt: skip


def add_subscriber(database_url: str, topic: str) -> None:
    """As the owner: `subscribers add --parts` builds the part indexes."""
    assert run_cli("migrate", "--database-url", database_url).returncode == 0
    added = run_cli("subscribers", "add", "orders", "--parts", str(PARTS), "--topic", topic,
                    "--format", "json", "--database-url", database_url)  # fmt: skip
    assert added.returncode == 0, added.stderr


def assert_exactly_once_in_order(kafka_bootstrap: str, topic: str) -> None:
    seen = consume(kafka_bootstrap, [topic], KEYS * PER_KEY, quiet=1.0)
    per_key: dict[str, list[int]] = {}
    for record in seen:
        per_key.setdefault(record.key.decode(), []).append(
            int(json.loads(record.value)["order_id"])
        )
    assert per_key == {f"k{k}": list(range(PER_KEY)) for k in range(KEYS)}


def live_sessions(db: psycopg.Connection[Any]) -> int:
    row = db.execute(
        "SELECT count(DISTINCT owner) FROM outbox_checkpoints WHERE owner IS NOT NULL"
    ).fetchone()
    return 0 if row is None else int(row[0])


@pytest.fixture
def two_workers(run_relay: Any, database_url: str, topic_prefix: str) -> RunningRelay:
    """``run --workers 2`` publishing a 4-part subscriber "orders", ready."""
    add_subscriber(database_url, topic_prefix + "orders")
    relay: RunningRelay = run_relay("--workers", "2")
    wait_until(lambda: len(relay.children()) == 2, what="two member processes")
    wait_until(lambda: relay.get("/readyz")[0] == 200, timeout=60, what="/readyz")
    return relay


def stops_cleanly(relay: RunningRelay, timeout: float = 180) -> bool:
    """SIGTERM: the relay exits 0 and its members are gone. ``timeout`` is only a
    ceiling for a loaded machine (it exceeds shutdown_timeout, after which the relay
    kills members itself and says so)."""
    children = relay.children()
    relay.proc.send_signal(signal.SIGTERM)
    assert relay.proc.wait(timeout=timeout) == 0, relay.output()
    return not any(Path(f"/proc/{pid}").exists() for pid in children)


def test_two_workers_share_the_parts_and_the_relay_reports_for_both(
    two_workers: RunningRelay, writer_url: str, kafka_bootstrap: str, topic_prefix: str,
    outbox: Outbox, db: psycopg.Connection[Any],
) -> None:  # fmt: skip
    write(writer_url, outbox, range(PER_KEY))
    wait_caught_up(db, "orders", timeout=60)
    assert_exactly_once_in_order(kafka_bootstrap, topic_prefix + "orders")

    assert live_sessions(db) == 2  # the parts are spread over both members
    status, body = two_workers.get("/readyz")
    assert status == 200 and "worker 0 ready" in body and "worker 1 ready" in body
    metrics = two_workers.get("/metrics")[1]
    published = re.findall(r'^outbox_relay_published_events_total\{part="\d",subscriber="orders"\} (\S+)$', metrics, re.M)  # fmt: skip
    assert len(published) == PARTS and sum(float(v) for v in published) == KEYS * PER_KEY
    assert stops_cleanly(two_workers)


@pytest.mark.chaos
def test_a_killed_worker_is_restarted_and_nothing_is_lost_or_repeated(
    two_workers: RunningRelay, writer_url: str, kafka_bootstrap: str, topic_prefix: str,
    outbox: Outbox, db: psycopg.Connection[Any],
) -> None:  # fmt: skip
    write(writer_url, outbox, range(PER_KEY // 2))
    os.kill(two_workers.children()[0], signal.SIGKILL)
    write(writer_url, outbox, range(PER_KEY // 2, PER_KEY))
    wait_until(lambda: "died: restarting it" in two_workers.output(), what="the restart")
    wait_until(lambda: len(two_workers.children()) == 2, what="the restarted member")
    wait_caught_up(db, "orders", timeout=90)
    assert_exactly_once_in_order(kafka_bootstrap, topic_prefix + "orders")
    assert two_workers.proc.poll() is None  # the relay itself never stopped
    assert stops_cleanly(two_workers)


def test_a_fatal_error_in_a_worker_stops_the_relay_with_it(
    run_relay: Any, database_url: str
) -> None:
    # The database is not migrated (so there is no relay role's grant to use yet).
    relay = run_relay("--workers", "2", RELAY_DATABASE_URL=database_url)
    deadline = time.monotonic() + 60
    while relay.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert relay.proc.returncode not in (None, 0)
    assert "worker process" in relay.output() and "outbox-relay migrate" in relay.output()
    assert relay.children() == []


def test_workers_must_be_a_positive_count(run_relay: Any) -> None:
    relay = run_relay("--workers", "0")
    assert relay.proc.wait(timeout=60) == 2
    assert "workers" in relay.output()


def handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has installed a SIGTERM handler (a member does so just
    before its start-up begins; until then SIGTERM would simply end it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    [caught] = re.findall(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def wait_both_waiting_for_postgres(relay: RunningRelay) -> None:
    def both_waiting() -> bool:
        members = relay.children()
        return (
            len(members) == 2
            and all(handles_sigterm(pid) for pid in members)
            and relay.output().count("cannot start yet") >= 2
        )

    # Two new interpreters import the relay and try Postgres (5 s each) first: slow on a
    # loaded machine, hence the long ceiling.
    wait_until(both_waiting, timeout=180, what="both members waiting for Postgres")


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_sigterm_stops_workers_still_waiting_for_the_database(run_relay: Any) -> None:
    # Nothing listens on port 1: every member waits for Postgres, retrying. A long
    # shutdown_timeout: a member that ignored SIGTERM is still told apart (the relay kills
    # it at that deadline and says so), and a slow machine's members are not killed.
    relay = run_relay(
        "--workers", "2",
        RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/x", RELAY_SHUTDOWN_TIMEOUT="60",
    )  # fmt: skip

    wait_both_waiting_for_postgres(relay)
    assert stops_cleanly(relay)
    # The members stopped on SIGTERM: none was killed at shutdown_timeout.
    assert "did not stop in time" not in relay.output()


def test_members_waiting_for_the_database_stop_when_their_supervisor_is_killed(
    run_relay: Any,
) -> None:
    # As by the OOM killer: the members never hear SIGTERM, and have no pipe to watch
    # yet while they wait for Postgres. They must not retry for ever as orphans.
    relay = run_relay("--workers", "2", RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/x")
    wait_both_waiting_for_postgres(relay)
    members = relay.children()
    relay.proc.kill()
    relay.proc.wait()
    wait_until(
        lambda: not any(running(pid) for pid in members),
        timeout=120,  # a ceiling: each notices at once, but the machine may be loaded
        what="the orphaned members to stop",
    )
