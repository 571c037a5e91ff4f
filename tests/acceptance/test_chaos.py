"""Chaos: relay processes killed, frozen past their session, Postgres restarted, and the
Apache Kafka broker paused and killed with ``kill -9`` while writers commit out of
order, roll back and hold long transactions. Every run must end with verify clean (0
lost, 0 duplicated, 0 out of order), and an independent read_committed consumer must
count exactly one record per outbox row on each subscriber's topics.

Cluster mode (marker ``cluster``): the same relays and writers on three Kafka nodes
(replication factor 3, min.insync.replicas 2); relays are killed as before, then every
node is restarted in turn. On top of the above, some part must always have an owner
(killing single nodes is test_cluster_availability.py's). Postgres is not restarted nor
a relay frozen: the single-broker run covers those.

Run alone with ``pytest -m chaos -s`` to see the figures.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.verify_queries import PostgresVerifyOutbox
from relay.core.subscribers import Subscriber, ValueFormat
from relay.errors import RelayError
from relay.localstack import LocalKafka, LocalKafkaCluster, LocalPostgres
from relay.ops.lag import part_lag, subscriber_lag
from relay.ops.verify import SubscriberReport, verify
from tests.acceptance.cluster_faults import (
    AvailabilityProbe,
    rolling_restart,
    wait_fully_replicated,
)
from tests.support import WriterLoops, consume, grant_test_roles, order, restart

pytestmark = pytest.mark.chaos

REPO = Path(__file__).resolve().parents[2]
CHAOS_SECONDS = float(os.environ.get("OUTBOX_CHAOS_SECONDS", "60"))
SEED = int(os.environ.get("OUTBOX_CHAOS_SEED", time.time()))
RELAYS = 3
SESSION_TIMEOUT = 3.0
KEYS = [f"k{i}" for i in range(40)]
_SESSION_LINE = re.compile(r"opened relay session ([0-9a-f-]{36})")


@dataclass
class Figures:
    committed_transactions: int = 0
    rolled_back: int = 0
    events_committed: int = 0
    writer_errors: int = 0
    kills: int = 0
    freezes: int = 0
    postgres_restarts: int = 0
    broker_pauses: int = 0
    broker_kills: int = 0
    rolling_restarts: int = 0
    relays_started: int = 0
    log: list[str] = field(default_factory=list)


class RelayProcesses:
    """``outbox-relay run`` subprocesses, each logging to its own file."""

    def __init__(self, env: dict[str, str], logs: Path, figures: Figures) -> None:
        self._env = {**os.environ, **env}
        self._logs = logs
        self._figures = figures
        self.procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self) -> subprocess.Popen[bytes]:
        self._figures.relays_started += 1
        log = (self._logs / f"relay-{self._figures.relays_started}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "run"],
            env=self._env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append((proc, log))
        return proc

    def sessions(self, proc: subprocess.Popen[bytes]) -> set[str]:
        """Session ids a relay logged (its pid may be namespaced differently)."""
        log = next(log for p, log in self.procs if p is proc)
        return set(_SESSION_LINE.findall(Path(log.name).read_text(errors="replace")))

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p, _ in self.procs if p.poll() is None]

    def stop_all(self) -> list[int]:
        """SIGTERM every live relay; their exit codes."""
        live = self.alive()
        for proc in live:
            proc.send_signal(signal.SIGCONT)  # in case one is frozen
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in live]
        for _, log in self.procs:
            log.close()
        return codes

    def kill_all(self) -> None:
        for proc in self.alive():
            proc.kill()
            proc.wait()


class Writers(WriterLoops):
    """Concurrent app transactions: several events each, random rollbacks, some long."""

    def __init__(self, url: str, outbox: Outbox, figures: Figures, threads: int = 4) -> None:
        super().__init__(url, threads, autocommit=True, pause=0.02)
        self._outbox = outbox
        self._figures = figures

    def burst(self, n: int = 4000) -> None:
        """One transaction of ``n`` events, from the chaos driver."""
        try:
            with psycopg.connect(self._url, connect_timeout=3) as conn, conn.transaction():
                for i in range(n):
                    key = KEYS[i % len(KEYS)]
                    self._outbox.append(
                        conn,
                        aggregate_type="order",
                        aggregate_id=key,
                        event_type="OrderPlaced",
                        payload=order(f"{key}-burst-{i}"),
                    )
        except (psycopg.Error, RelayError):
            with self._lock:
                self._figures.writer_errors += 1

    def _failed(self) -> None:  # Postgres restarts are expected
        self._figures.writer_errors += 1

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        # Mostly small transactions, sometimes a burst that gives the relays a backlog,
        # so kills often land mid-batch.
        n = rng.randint(100, 300) if rng.random() < 0.04 else rng.randint(1, 5)
        rollback = rng.random() < 0.1
        with conn.transaction(force_rollback=rollback):
            conn.execute("SELECT pg_current_xact_id()")  # take the xid early: commits reorder
            for _ in range(n):
                key = rng.choice(KEYS)
                self._outbox.append(
                    conn,
                    aggregate_type="order",
                    aggregate_id=key,
                    event_type="OrderPlaced",
                    payload=order(f"{key}-{rng.randrange(10**6)}"),
                )
                if n <= 5:
                    time.sleep(rng.uniform(0, 0.005))
            if rng.random() < 0.03:
                time.sleep(rng.uniform(1.0, 2.5))  # a long transaction holds the horizon
        with self._lock:
            if rollback:
                self._figures.rolled_back += 1
            else:
                self._figures.committed_transactions += 1
                self._figures.events_committed += n


def _caught_up(url: str, names: list[str]) -> bool:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=3) as conn:
            store = OutboxStore(conn)
            return all(subscriber_lag(store, store.get(n)).events == 0 for n in names)
    except psycopg.Error:
        return False


def _stall_report(url: str, logs: Path) -> str:
    """Where publication stands, for a failure message: parts, sessions, horizon."""
    lines = [f"\nrelay logs: {logs}"]
    with psycopg.connect(url, autocommit=True, connect_timeout=3) as conn:
        store = OutboxStore(conn)
        for state in store.list():
            for part in state.parts:
                lines.append(
                    f"part {state.subscriber.name}/{part.part}: checkpoint {part.checkpoint} "
                    f"owner {part.owner} halted {part.halted_error} pending {part_lag(store, part)}"
                )
        for row in conn.execute(
            "SELECT pg_snapshot_xmin(pg_current_snapshot()), (SELECT max(transaction_id) FROM"
            " outbox), (SELECT count(*) FROM outbox_relay_sessions)"
        ):
            lines.append(f"horizon, newest key, sessions: {row}")
        for row in conn.execute(
            "SELECT pid, state, backend_xid, backend_xmin, left(query, 80) FROM pg_stat_activity"
            " WHERE backend_xid IS NOT NULL OR backend_xmin IS NOT NULL"
        ):
            lines.append(f"backend: {row}")
    return "\n".join(lines)


def _busy_sessions(url: str, until: float) -> set[str]:
    """Sessions owning a part with unpublished events (polled until ``until``)."""
    while time.monotonic() < until:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
                store = OutboxStore(conn)
                busy = {
                    part.owner
                    for state in store.list()
                    for part in state.parts
                    if part.owner is not None and part_lag(store, part).events
                }
                if busy:
                    return {str(b) for b in busy}
        except psycopg.Error:
            pass
        time.sleep(0.01)
    return set()


class SingleBroker:
    """Broker faults on the one local broker: a pause, then a ``kill -9``."""

    def __init__(self, broker: LocalKafka, figures: Figures, rng: random.Random) -> None:
        self._broker = broker
        self._figures = figures
        self._rng = rng
        self.faults = [self.pause, self.kill]

    def pause(self) -> str:
        _signal_broker(self._broker, signal.SIGSTOP)
        time.sleep(3)
        _signal_broker(self._broker, signal.SIGCONT)
        self._figures.broker_pauses += 1
        return "broker paused 3s"

    def kill(self) -> str:
        began = time.monotonic()
        _signal_broker(self._broker, signal.SIGKILL)
        time.sleep(self._rng.uniform(0.5, 2.0))
        self._broker.start()  # same ports, same log directory
        self._figures.broker_kills += 1
        return f"broker kill -9, back after {time.monotonic() - began:.1f}s"


class ClusterBrokers:
    """Broker faults on a cluster: a rolling restart of every node (the node kills are
    test_cluster_availability.py's)."""

    def __init__(self, cluster: LocalKafkaCluster, figures: Figures) -> None:
        self._cluster = cluster
        self._figures = figures
        self.faults = [self.rolling_restart]
        #: Set while a fault is under way: what the availability probe judges.
        self.in_fault = threading.Event()

    def rolling_restart(self) -> str:
        # The loop has just killed a relay: let a peer take its parts over first, so
        # what is judged below is the brokers' doing.
        time.sleep(SESSION_TIMEOUT + 2)
        self.in_fault.set()
        try:
            rolling_restart(self._cluster, self._figures.log)
        finally:
            self.in_fault.clear()
        self._figures.rolling_restarts += 1
        return "rolling restart done"


def _chaos_loop(
    relays: RelayProcesses,
    postgres: LocalPostgres | None,
    brokers: SingleBroker | ClusterBrokers,
    figures: Figures,
    rng: random.Random,
    burst: Callable[[], None],
    url: str,
) -> None:
    """Relay kills throughout; once each, a relay frozen and Postgres restarted (unless
    ``postgres`` is None), then the broker faults one after the other."""
    started = time.monotonic()
    done = {"freeze": postgres is None, "postgres": postgres is None}
    broker_faults = list(brokers.faults)
    spared: set[int] = set()
    while (elapsed := time.monotonic() - started) < CHAOS_SECONDS or broker_faults:
        time.sleep(rng.uniform(1.5, 3.5))
        # A burst right before the kill, and the victim is a relay that owns a part
        # with a backlog: most kills land mid-batch, inside the crash windows.
        burst()
        busy = _busy_sessions(url, time.monotonic() + 1.0)
        time.sleep(rng.uniform(0, 0.1))  # somewhere inside the burst's publication
        live = relays.alive()
        if live:
            # Spare the relay thawed after SIGSTOP: it must stand down on its own.
            candidates = [p for p in live if p.pid not in spared] or live
            victim = next(
                (p for p in candidates if relays.sessions(p) & busy), rng.choice(candidates)
            )
            victim.kill()
            victim.wait()
            figures.kills += 1
            figures.log.append(f"{time.monotonic() - started:5.1f}s kill -9 pid {victim.pid}")
        relays.start()
        if elapsed > CHAOS_SECONDS * 0.2 and not done["freeze"]:
            done["freeze"] = True
            frozen = rng.choice(relays.alive())
            frozen.send_signal(signal.SIGSTOP)
            figures.freezes += 1
            figures.log.append(f"{elapsed:5.1f}s SIGSTOP pid {frozen.pid}")
            time.sleep(SESSION_TIMEOUT + 3)  # its session expires; a peer takes over
            frozen.send_signal(signal.SIGCONT)
            spared.add(frozen.pid)
            figures.log.append(f"{time.monotonic() - started:5.1f}s SIGCONT pid {frozen.pid}")
        elif elapsed > CHAOS_SECONDS * 0.45 and not done["postgres"]:
            done["postgres"] = True
            assert postgres is not None
            restart(postgres)
            figures.postgres_restarts += 1
            figures.log.append(f"{elapsed:5.1f}s postgres restarted")
        elif elapsed > CHAOS_SECONDS * 0.6 and broker_faults and all(done.values()):
            figures.log.append(f"{elapsed:5.1f}s {broker_faults.pop(0)()}")


def _signal_broker(broker: LocalKafka, signum: int) -> None:
    assert broker.pid is not None, "the broker is not running"
    os.kill(broker.pid, signum)
    while signum == signal.SIGKILL and broker.running:
        time.sleep(0.01)


@pytest.mark.timeout(CHAOS_SECONDS + 600)  # the chaos, then catching up and verifying
def test_exactly_once_through_kills_freezes_restarts_and_outages(
    local_postgres: LocalPostgres,
    local_kafka: LocalKafka,
    tmp_path: Path,
    topic_prefix: str,
    outbox: Outbox,
) -> None:
    rng = random.Random(SEED)
    figures = Figures()
    brokers = SingleBroker(local_kafka, figures, rng)
    summary = _run_chaos(
        local_postgres, local_postgres, local_kafka.bootstrap_servers, brokers, figures, rng,
        tmp_path, topic_prefix, outbox,
    )  # fmt: skip
    assert figures.kills >= 5 and figures.postgres_restarts
    assert figures.broker_pauses and figures.broker_kills
    _assert_delivered(summary)


@pytest.mark.cluster
@pytest.mark.timeout(CHAOS_SECONDS + 900)
def test_exactly_once_on_a_cluster_through_relay_kills_and_a_rolling_restart(
    local_postgres: LocalPostgres,
    kafka_cluster: LocalKafkaCluster,
    tmp_path: Path,
    topic_prefix: str,
    outbox: Outbox,
) -> None:
    wait_fully_replicated(kafka_cluster)
    rng = random.Random(SEED)
    figures = Figures()
    brokers = ClusterBrokers(kafka_cluster, figures)
    summary = _run_chaos(
        local_postgres, None, kafka_cluster.bootstrap_servers, brokers, figures, rng,
        tmp_path, topic_prefix, outbox,
        # Three replicas of every write on this shared 2-core machine: each transaction
        # costs several times what it does on one broker, so larger batches and a
        # lighter load, or the single-part subscriber never catches up within the test.
        writer_threads=2, burst_events=1000, batch_size=500,
    )  # fmt: skip
    assert figures.kills >= 5 and figures.rolling_restarts
    _assert_delivered(summary)
    # Through the rolling restart, at no moment was every part of the sharded
    # subscriber without an owner.
    assert summary["availability"]["ownerless_samples"] == 0, summary["availability"]


def _run_chaos(
    postgres: LocalPostgres,
    restartable: LocalPostgres | None,
    bootstrap: str,
    brokers: SingleBroker | ClusterBrokers,
    figures: Figures,
    rng: random.Random,
    tmp_path: Path,
    topic_prefix: str,
    outbox: Outbox,
    *,
    writer_threads: int = 4,
    burst_events: int = 4000,
    batch_size: int = 50,
) -> dict[str, Any]:
    """Relays and writers through :func:`_chaos_loop`; then they catch up, and the
    figures, verify's reports and an independent consumer's counts are returned."""
    url = postgres.url
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
        store = OutboxStore(conn)
        store.add(Subscriber("sharded", topic=topic_prefix + "avro.{aggregate_type}", parts=3))
        store.add(
            Subscriber(
                "json", topic=topic_prefix + "json.{aggregate_type}", value_format=ValueFormat.JSON
            )
        )
    roles = grant_test_roles(url)  # relays and writers as production runs them
    env = {
        "RELAY_DATABASE_URL": roles.relay_url,
        "RELAY_BOOTSTRAP_SERVERS": bootstrap,
        "RELAY_SCHEMAS_DIR": str(REPO / "schemas"),  # the "sharded" subscriber is Avro
        "RELAY_SESSION_TIMEOUT": str(SESSION_TIMEOUT),
        "RELAY_HEARTBEAT_INTERVAL": "0.5",
        "RELAY_POLL_INTERVAL": "0.2",
        "RELAY_BATCH_SIZE": str(batch_size),
        "RELAY_DELIVERY_TIMEOUT": "10",
        "RELAY_SHUTDOWN_TIMEOUT": "10",
        "RELAY_METRICS_PORT": "0",  # three relays on one host: any free port
    }
    relays = RelayProcesses(env, tmp_path, figures)
    writers = Writers(roles.writer_url, outbox, figures, writer_threads)
    # Judged during the broker faults only: relay kills in quick succession may leave
    # only relays still starting, with no part yet, and that is no broker's doing.
    in_fault = getattr(brokers, "in_fault", None)
    probe = AvailabilityProbe(
        url,
        "sharded",
        lambda: [None for _ in relays.alive()] if in_fault and in_fault.is_set() else None,
    )
    began = time.monotonic()
    try:
        for _ in range(RELAYS):
            relays.start()
        writers.start()
        if restartable is None:  # the probe's connection would not survive a restart
            probe.start()
        burst = functools.partial(writers.burst, burst_events)
        _chaos_loop(relays, restartable, brokers, figures, rng, burst, url)
        writers.stop()
        deadline = time.monotonic() + 120
        while not _caught_up(url, ["sharded", "json"]):
            if time.monotonic() > deadline:
                for proc in relays.alive():  # their thread stacks, into their logs
                    proc.send_signal(signal.SIGUSR1)
                time.sleep(1)
                raise AssertionError(
                    "relays never caught up:\n"
                    + "\n".join(figures.log)
                    + _stall_report(url, tmp_path)
                )
            time.sleep(0.5)
        seen = probe.stop() if probe.is_alive() else None
        codes = relays.stop_all()
    finally:
        writers.stop()
        if probe.is_alive():
            probe.stop()
        relays.kill_all()
    duration = time.monotonic() - began

    with psycopg.connect(url, autocommit=True) as conn:
        reader = KafkaTopicReader({"bootstrap.servers": bootstrap})
        reports = verify(OutboxStore(conn), PostgresVerifyOutbox(conn), reader)
        rows = conn.execute("SELECT count(*) FROM outbox").fetchone()
        outbox_rows = rows[0] if rows else 0
    # An independent consumer per subscriber: plain read_committed, trusting the broker.
    committed = {r.subscriber: consume(bootstrap, r.topics, outbox_rows) for r in reports}
    # Records of transactions aborted by kills and fencing: on the log, hidden above.
    uncommitted = sum(
        len(consume(bootstrap, r.topics, outbox_rows, isolation="read_uncommitted"))
        for r in reports
    )
    aborted = uncommitted - sum(len(records) for records in committed.values())
    summary = {
        "seed": SEED,
        "logs": str(tmp_path),
        "duration_s": round(duration, 1),
        "events_committed": figures.events_committed,
        "outbox_rows": outbox_rows,
        "transactions_committed": figures.committed_transactions,
        "transactions_rolled_back": figures.rolled_back,
        "relay_kills": figures.kills,
        "relay_freezes": figures.freezes,
        "postgres_restarts": figures.postgres_restarts,
        "broker_pauses": figures.broker_pauses,
        "broker_kills": figures.broker_kills,
        "rolling_restarts": figures.rolling_restarts,
        "relays_started": figures.relays_started,
        "writer_errors": figures.writer_errors,
        "aborted_records_on_topics": aborted,
        "independent_consumer": {name: len(records) for name, records in committed.items()},
        "availability": seen.as_dict() if seen is not None else None,
        "reports": [r.as_dict() for r in reports],
    }
    print(json.dumps(summary, indent=2))
    print("\n".join(figures.log))
    summary.update(codes=codes, committed=committed, report_objects=reports)
    return summary


def _assert_delivered(summary: dict[str, Any]) -> None:
    codes = summary["codes"]
    assert codes and all(code == 0 for code in codes), f"SIGTERM exit codes {codes}"
    outbox_rows = summary["outbox_rows"]
    _assert_clean(summary["report_objects"], outbox_rows)
    for name, records in summary["committed"].items():
        ids = [r.message_id for r in records]
        assert len(ids) == outbox_rows == len(set(ids)), (
            f"{name}: {len(ids)} records, {len(set(ids))} distinct, {outbox_rows} rows"
        )


def _assert_clean(reports: list[SubscriberReport], outbox_rows: int) -> None:
    for report in reports:
        assert report.expected == outbox_rows, report.as_dict()
        assert (report.missing, report.duplicated, report.out_of_order) == (0, 0, 0), (
            report.as_dict()
        )
        assert report.found == outbox_rows
        assert report.ahead == 0
