"""The benchmark harness: an embedded stack, figures with same-run baselines, a report.

Every benchmark module exposes ``run(stack: Stack, scale: Scale) -> list[Figure]``.
A figure is an absolute value measured on this machine plus, where the benchmark has
one, the baseline measured in the same run and the ratio between the two: machines
are noisy, ratios travel.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.method import CpuMeter, Samples, ratio_range
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.settings import Settings, load_settings
from relay.core.subscribers import StartFrom, Subscriber
from relay.localstack import LocalKafka, LocalPostgres
from relay.localstack.process import free_port

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "schemas"
RESULTS = REPO / "bench" / "results"
# The relays' batch size in every benchmark (the default): the first batch lands before
# a rate's clock starts, so rates leave it out.
BATCH = 5000
NOTE = "x" * 230  # makes an OrderPlaced Avro value about 300 bytes
# Names a checkout of the code before a change (e.g. a worktree of an older commit):
# bounded and fanout then run its relay beside this one's, for before/after figures.
BASELINE_CODE = "OUTBOX_BENCH_BASELINE_CODE"


@dataclass(frozen=True)
class Scale:
    """How big the runs are. ``quick`` finishes in minutes and only tries the method;
    ``default`` and ``full`` follow it (bench/README.md "Method"): backlogs of at least
    a million events, five interleaved repetitions."""

    name: str = "default"
    repetitions: int = 5  # interleaved rounds of every side of a comparison
    events: int = 200_000  # the backlogs of benchmarks not yet on the method
    throughput_events: int = 1_000_000  # throughput's backlog
    big_backlog: int = 2_000_000  # write_costs' outbox
    growth_backlog: int = 4_000_000  # cost growth: big against small backlog
    small_backlog: int = 1_000_000
    # In all: each of 100 filtered subscribers takes 1/100, in at least 10 batches
    # (fanout.py sets its batch size so): with one batch each, the figure was the
    # broker's cost per transaction, not publishing.
    fanout_events: int = 1_000_000
    # Each of 4 parts publishes a quarter: at 100,000 in all a run lasts about 2 s, and
    # the spread of parts over processes and their first batches swamp the figure.
    sharding_events: int = 600_000
    # Debezium side by side (bench/debezium.py): each round drains a warm-up backlog
    # first (a warm JVM, and the same for the relay), then the measured one.
    debezium_warmup: int = 300_000
    debezium_events: int = 1_000_000
    latency_seconds: float = 30.0
    latency_rate: int = 1000
    # The soak (bench/soak.py): 8 minutes at 3k ev/s with retention on, as issue #27 asks.
    soak_seconds: float = 480.0
    soak_rate: int = 3000

    @classmethod
    def named(cls, name: str) -> Scale:
        if name == "quick":
            return cls(name, 3, events=100_000, throughput_events=50_000, big_backlog=500_000,
                       growth_backlog=200_000, small_backlog=50_000, fanout_events=100_000,
                       debezium_warmup=20_000, debezium_events=50_000, latency_seconds=8.0, soak_seconds=90.0)  # fmt: skip
        if name == "full":
            return cls(name, big_backlog=10_000_000, growth_backlog=10_000_000,
                       fanout_events=5_000_000, latency_seconds=60.0)  # fmt: skip
        return cls()


@dataclass
class Figure:
    """One reported number: ``value`` (in ``unit``) against ``baseline`` when given."""

    benchmark: str
    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str | None = None
    # "ratio>=0.5", "value<=5", ... checked by :attr:`met`; None when there is no target.
    target: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # Interleaved repetitions (bench/method.py): value and baseline are then medians,
    # and these are the lowest and highest of each, and of the rounds' ratios.
    repetitions: int = 1
    value_range: tuple[float, float] | None = None
    baseline_range: tuple[float, float] | None = None
    ratio_range: tuple[float, float] | None = None

    @classmethod
    def of(
        cls,
        benchmark: str,
        name: str,
        value: Samples,
        unit: str,
        baseline: Samples | None = None,
        baseline_name: str | None = None,
        target: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> Figure:
        """A figure from interleaved repetitions: medians, with their ranges."""
        return cls(
            benchmark, name, value.median, unit,
            baseline.median if baseline is not None else None, baseline_name, target,
            details or {}, len(value.values), (value.low, value.high),
            (baseline.low, baseline.high) if baseline is not None else None,
            ratio_range(value, baseline) if baseline is not None else None,
        )  # fmt: skip

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        assert self.baseline is not None
        return self.value / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        subject, op, bound = _parse_target(self.target)
        actual = self.ratio if subject == "ratio" else self.value
        if actual is None:
            return None
        return actual >= bound if op == ">=" else actual <= bound

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def _parse_target(target: str) -> tuple[str, str, float]:
    for op in (">=", "<="):
        subject, sep, bound = target.partition(op)
        if sep:
            return subject.strip(), op, float(bound)
    raise ValueError(f"bad target {target!r}: expected 'ratio>=N' or 'value<=N'")


class Stack:
    """One local Postgres and one broker for the whole run; a fresh database per use."""

    def __init__(self, workdir: Path, *, fsync: bool) -> None:
        self.workdir = workdir
        self.postgres = LocalPostgres(workdir / "pg", fsync=fsync)
        self.broker = LocalKafka(workdir / "kafka")
        self._names = itertools.count(1)

    def __enter__(self) -> Stack:
        self.postgres.start()
        try:
            self.broker.start()
        except BaseException:
            self.postgres.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.broker.stop()
        finally:
            self.postgres.stop()

    def fresh_broker(self) -> None:
        """Restart the broker with an empty log, so one benchmark's records do not weigh
        on the next."""
        self.broker.stop()
        shutil.rmtree(self.broker.work_dir, ignore_errors=True)
        self.broker.start()

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def database(self, label: str, server: LocalPostgres | None = None) -> str:
        """A new, migrated database on ``server`` (the stack's Postgres by default);
        returns its URL."""
        server = server or self.postgres
        name = f"bench_{next(self._names)}_{label}"
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        url = server.url_for(name)
        with psycopg.connect(url, autocommit=True) as conn:
            migrations.migrate(conn)
        return url

    def topic_prefix(self, label: str) -> str:
        return f"bench{next(self._names)}.{label}"

    def fault_run(self, label: str, fault: str) -> tuple[str, str, float]:
        """A fault run's new database (its owner's URL), its topic prefix, and the
        1-minute load average at its start, which it prints."""
        url = self.database(label)
        prefix = f"{self.topic_prefix(label)}."
        load = os.getloadavg()[0]
        print(f"   {time.strftime('%X')} {fault}, load {load:.1f}", file=sys.stderr, flush=True)
        return url, prefix, load


def create_topics(
    bootstrap: str, topics: list[str], partitions: int, config: dict[str, str] | None = None
) -> None:
    """Create ``topics`` (the broker creates none by itself, as in production)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = [
        NewTopic(t, num_partitions=partitions, replication_factor=-1, config=config or {})
        for t in topics
    ]
    for future in admin.create_topics(new).values():
        future.result(15)


def order_payload(i: int = 0) -> dict[str, Any]:
    return {
        "order_id": f"o-{i}",
        "customer_id": f"c-{i % 1000}",
        "amount_cents": i,
        "currency": "EUR",
        "note": NOTE,
    }


def fill_outbox(
    url: str, events: int, *, keys: int = 1000, types: int = 1, chunk: int = 1_000_000
) -> None:
    """COPY ``events`` OrderPlaced rows into the outbox, a million per transaction; with
    ``types`` > 1, their aggregate types take turns: order0, order1, ..."""
    payload = json.dumps(order_payload())
    with psycopg.connect(url) as conn:
        for start in range(0, events, chunk):
            with (
                conn.cursor() as cur,
                cur.copy(
                    "COPY outbox (aggregate_type, aggregate_id, event_type, payload) FROM STDIN"
                ) as copy,
            ):
                for i in range(start, min(events, start + chunk)):
                    aggregate_type = f"order{i % types}" if types > 1 else "order"
                    copy.write_row((aggregate_type, str(i % keys), "OrderPlaced", payload))
            conn.commit()
        conn.execute("ANALYZE outbox")
        conn.commit()


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as elapsed:`` … ``elapsed[0]`` is the seconds taken."""
    elapsed = [0.0]
    start = time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed[0] = time.perf_counter() - start


def report(figures: list[Figure], *, scale: str, started: float) -> Path:
    """Print the table and write bench/results/<timestamp>.json (and latest.json)."""
    header = (
        f"{'benchmark':<12} {'figure':<52} {'value [range]':>30} {'baseline [range]':>26}"
        f" {'ratio [range]':>20} {'n':>2} {'target':>12} {'met':>4}"
    )
    print(header)
    print("-" * len(header))
    for f in figures:
        value = f"{_num(f.value)}{_span(f.value_range)} {f.unit}"
        base = _num(f.baseline) + _span(f.baseline_range) if f.baseline is not None else "-"
        ratio = "-"
        if f.ratio is not None:
            low_high = f" [{f.ratio_range[0]:.2f}-{f.ratio_range[1]:.2f}]" if f.ratio_range else ""
            ratio = f"{f.ratio:.2f}x{low_high}"
        met = {True: "yes", False: "NO", None: "-"}[f.met]
        print(
            f"{f.benchmark:<12} {f.name:<52} {value:>30} {base:>26} {ratio:>20}"
            f" {f.repetitions:>2} {f.target or '-':>12} {met:>4}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    document = {
        "scale": scale,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "figures": [f.as_json() for f in figures],
    }
    text = json.dumps(document, indent=2)
    path = RESULTS / f"bench-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json"
    path.write_text(text)
    (RESULTS / "latest.json").write_text(text)
    return path


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _span(bounds: tuple[float, float] | None) -> str:
    return f" [{_num(bounds[0])}-{_num(bounds[1])}]" if bounds is not None else ""


def relay_settings(stack: Stack, url: str, label: str, **overrides: Any) -> Settings:
    """Settings of an in-process relay on ``url``, with Kafka ids unique to this run."""
    prefix = stack.topic_prefix(label)
    return load_settings(
        database_url=url,
        bootstrap_servers=stack.bootstrap,
        schemas_dir=SCHEMAS,
        metrics_enabled=False,
        prune_every=0,
        kafka_id_prefix=prefix,
        checkpoint_topic=f"{prefix}.checkpoints",
        **overrides,
    )


def subscriber(name: str, topic: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "topic": topic, **fields}


def final_positions(url: str) -> dict[tuple[str, int], tuple[int, int]]:
    """The last outbox row of every subscriber part: where its checkpoint ends up."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT s.name, p.part, last.tx, last.pos
                 FROM outbox_subscribers s
                 CROSS JOIN LATERAL generate_series(0, s.parts - 1) AS p(part)
                 CROSS JOIN LATERAL (
                   SELECT o.transaction_id::text::bigint AS tx, o.position AS pos
                     FROM outbox o
                    WHERE s.parts = 1 OR outbox_part(o.aggregate_id, s.parts) = p.part
                    ORDER BY o.transaction_id DESC, o.position DESC LIMIT 1) AS last"""
        ).fetchall()
    return {(name, part): (tx, pos) for name, part, tx, pos in rows}


def wait_published(
    url: str,
    targets: dict[tuple[str, int], tuple[int, int]],
    timeout: float = 3600,
    tick: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Poll checkpoints until every part reaches its target.

    Returns (the time the first checkpoint moved, the time the last target was reached),
    as ``time.perf_counter()`` values: the span excludes the relay's start-up.
    """
    first_move: float | None = None
    deadline = time.perf_counter() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.perf_counter() < deadline:
            rows = conn.execute(
                "SELECT subscriber, part, transaction_id::text::bigint, position"
                " FROM outbox_checkpoints"
            ).fetchall()
            now = time.perf_counter()
            reached = {(s, p): (tx, pos) for s, p, tx, pos in rows}
            if first_move is None and any(tx > 0 for tx, _ in reached.values()):
                first_move = now
            if all(reached.get(k, (0, 0)) >= v for k, v in targets.items()):
                return first_move if first_move is not None else now, now
            if tick is not None:
                tick()  # e.g. check the relays are alive, sample their memory
            time.sleep(0.01)
    raise TimeoutError(f"relay did not publish everything within {timeout:.0f}s")


def add_subscribers(url: str, subscribers: list[Subscriber]) -> None:
    """As `outbox-relay subscribers add` does: part indexes included."""
    with psycopg.connect(url, autocommit=True) as conn:
        store = OutboxStore(conn)
        for sub in subscribers:
            store.add(sub, StartFrom.BEGINNING)
        store.index_parts()


class RelayProcesses:
    """``outbox-relay run`` processes, as users run them (``python -m relay run``)."""

    def __init__(
        self, stack: Stack, url: str, label: str, count: int = 1, *, code: Path = REPO, **env: Any
    ) -> None:
        # ``code``: the checkout whose relay runs (another worktree: a before/after figure).
        self._code = code
        if "metrics_port" in env and "probe_port" not in env:
            # Else the relay takes metrics_port + 1, which nothing made sure was free;
            # taken, the relay exits at start-up (as one did in a fanout run, #53, its
            # log lost with the run's directory).
            env = {**env, "probe_port": free_port()}
        prefix = stack.topic_prefix(label)
        self.env = {
            **os.environ,
            "RELAY_DATABASE_URL": url,
            "RELAY_BOOTSTRAP_SERVERS": stack.bootstrap,
            "RELAY_SCHEMAS_DIR": str(SCHEMAS),
            "RELAY_METRICS_ENABLED": "false",
            "RELAY_PRUNE_EVERY": "0",
            "RELAY_KAFKA_ID_PREFIX": prefix,
            "RELAY_CHECKPOINT_TOPIC": f"{prefix}.checkpoints",
            "RELAY_LOG_LEVEL": "WARNING",
            **{f"RELAY_{key.upper()}": str(value) for key, value in env.items()},
        }
        self.logs = [stack.workdir / f"{prefix}.relay{i}.log" for i in range(count)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> RelayProcesses:
        for log in self.logs:
            with log.open("ab") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "relay", "run"],
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=self._code,
                    )
                )
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def rss_mb(self) -> list[float]:
        """Resident memory of each process now, in MiB."""
        return [_status_kib(p.pid, "VmRSS") / 1024 for p in self.procs]

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each process so far (VmHWM), in MiB."""
        return [_status_kib(p.pid, "VmHWM") / 1024 for p in self.procs]

    def threads(self) -> int:
        """Threads of every process now, summed (``Threads:`` of /proc/<pid>/status)."""
        return sum(_status_kib(p.pid, "Threads") for p in self.procs)

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"relay exited with {proc.returncode}; see {log}")


def _status_kib(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1])
    return 0


# -- child processes (writers, consumers): spawned, as librdkafka and psycopg run threads

SPAWN = multiprocessing.get_context("spawn")  # never fork


def spawn_child(target: Callable[..., None], *args: Any) -> tuple[BaseProcess, Connection]:
    """Start ``target(*args, out)`` in a child process; returns it and the end of ``out``
    the parent reads (see :func:`receive`)."""
    receiver, sender = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=target, args=(*args, sender), daemon=True)
    process.start()
    sender.close()  # the child holds its own copy
    return process, receiver


def receive(conn: Connection, process: BaseProcess, timeout: float) -> Any:
    """The child's one result; raises if it dies or takes longer than ``timeout``."""
    wait_until(conn.poll, process, timeout, f"a result from {process.name}")
    try:
        return conn.recv()
    except EOFError:  # it died before sending
        process.join(5.0)
        raise RuntimeError(f"{process.name} exited with code {process.exitcode}") from None


def wait_until(
    done: Callable[[], bool], process: BaseProcess, timeout: float, what: str | None
) -> None:
    """Until ``done()``; raises if ``process`` dies first, or (if ``what``) on timeout."""
    deadline = time.monotonic() + timeout
    while not done():
        if not process.is_alive() and not done():
            raise RuntimeError(f"{process.name} exited with code {process.exitcode}")
        if time.monotonic() > deadline:
            if what is None:
                return
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def reap(*processes: BaseProcess | None) -> None:
    for process in processes:
        if process is None:
            continue
        process.join(10.0)
        if process.is_alive():
            process.terminate()
            process.join(5.0)


# -- paused starts: a relay's clock runs from resume, as a baseline's from its start


def set_all_paused(url: str, *, paused: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE outbox_subscribers SET paused = %s", (paused,))


def wait_all_paused(port: int, parts: int, check: Callable[[], None], timeout: float = 600) -> None:
    """Wait until the relay's /metrics shows ``parts`` parts started and paused."""
    paused = re.compile(r'^outbox_relay_part_state\{.*state="paused".*\} 1\.0$', re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                body = r.read().decode()
        except OSError:
            body = ""  # not listening yet
        if len(paused.findall(body)) == parts:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{parts} parts did not start within {timeout:.0f}s")


def server_roots(stack: Stack) -> dict[str, Callable[[], list[int | None]]]:
    """The stack's processes for a :class:`~bench.method.CpuMeter`: Postgres (the
    postmaster, whose descendants are every backend) and the broker."""
    return {"postgres": lambda: [stack.postgres.pid], "broker": lambda: [stack.broker.pid]}


def client_meter(stack: Stack) -> CpuMeter:
    """CPU of a baseline run in this process ("client", without the servers it started)."""
    return CpuMeter({"client": lambda: [os.getpid()], **server_roots(stack)}, alone={"client"})


@dataclass
class Drain:
    """One relay run over a backlog, clocked from the resume of its paused subscribers."""

    seconds: float  # resume to every part's last checkpoint
    startup: float  # relay start to every part started and paused
    cpu: dict[str, float]  # cores used per process over ``seconds``
    peak_rss_mb: float
    rss_mb: list[float]  # samples over the run, summed over the relay's processes
    # The most threads the relay's processes ran at once while publishing, librdkafka's
    # native ones included (issue #30: they grew with the parts).
    threads: int = 0
    # Producers the relay opened, summed over its parts (None: a relay without the
    # counter): a part opens one per turn on which the pool had closed its last.
    producers_opened: int | None = None


def paused_drain(
    stack: Stack, url: str, label: str, parts: int, *, code: Path = REPO, **env: Any
) -> Drain:
    """Publish the backlog of ``url`` with one ``outbox-relay run`` process.

    Its subscribers start paused; once all ``parts`` are started (producers fenced,
    checkpoints read) they are resumed together and the clock starts, as a baseline's
    starts when it begins to read. Start-up is returned on its own.
    """
    targets = final_positions(url)
    set_all_paused(url, paused=True)
    port = free_port()
    samples: list[float] = []
    threads: list[int] = []
    with RelayProcesses(stack, url, label, poll_interval=0.1, metrics_enabled=True,
                        metrics_port=port, code=code, **env) as relays:  # fmt: skip
        started = time.perf_counter()
        wait_all_paused(port, parts, relays.check_alive)
        startup = time.perf_counter() - started

        def tick() -> None:
            relays.check_alive()
            samples.append(sum(relays.rss_mb()))
            threads.append(relays.threads())

        meter = CpuMeter({"relay": lambda: [p.pid for p in relays.procs], **server_roots(stack)})
        with meter:
            resumed = time.perf_counter()
            set_all_paused(url, paused=False)
            _, done = wait_published(url, targets, tick=tick)
            meter.sample()  # before the relay stops
        opened = metric_total(port, "outbox_relay_producers_opened_total")
        peak = sum(relays.peak_rss_mb())
    return Drain(done - resumed, startup, meter.as_json(), peak, samples, max(threads, default=0),
                 opened)  # fmt: skip


def metric_total(port: int, name: str) -> int | None:
    """The sum of the samples of counter ``name`` on the relay's /metrics (None: no
    such counter, as on the code of an older checkout)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)
    return round(sum(float(v) for v in values)) if values else None


def fresh_subscribers(url: str, subscribers: list[Subscriber]) -> None:
    """Replace every subscriber of ``url`` by ``subscribers``, reading from the start:
    each repetition publishes the same backlog again without writing it again."""
    with psycopg.connect(url, autocommit=True) as conn:
        store = OutboxStore(conn)
        for old in store.list():
            store.remove(old.subscriber.name)
    add_subscribers(url, subscribers)
