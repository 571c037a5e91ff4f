"""Write-path benchmarks: what the append API costs an app, and how writers scale.

**Append API overhead** (target ``ratio<=1.15``). One client runs single-row
transactions, ``BEGIN; <append one OrderPlaced>; COMMIT``, three ways on the same
connection and table:

- ``api``: :meth:`relay.Outbox.append` over ``schemas/``, which is what ``relay.append``
  does by default: validate the payload against its Avro schema (fastavro), then
  ``INSERT ... RETURNING message_id``. The headline value.
- ``api_unvalidated``: ``Outbox(None)``, the documented opt-out. Details only; it
  shows what validation costs.
- ``sql`` (baseline): the plain ``INSERT INTO outbox (aggregate_type, aggregate_id,
  event_type, payload) VALUES (%s, %s, %s, %s)`` of docs/writing-events.md (a), with
  the payload adapted by psycopg's ``Jsonb`` exactly as the API does it.

Every side builds the same payload, runs on an autocommit connection with an explicit
``conn.transaction()`` (so BEGIN and COMMIT are real round trips for all of them), and
gets psycopg's automatic prepared statements after an untimed warm-up. A commit costs
an fsync, and the machine is shared and noisy. So the sides take turns in short rounds
of :data:`ROUND_TX` transactions, rotating which side goes first. Each side's figure is
the median over its rounds of the time per transaction. Lower is better, and
ratio = api / sql. For the range (bench/method.py), the rounds are cut into
``scale.repetitions`` consecutive blocks: the range is that of the blocks' medians. Each round also times the same appends inside one (rolled back)
transaction, i.e. without a commit each, for the details: the client's own share.

**Concurrent writers vs eventsourcing** (no target; the ratio is reported). Writer
threads, each with its own connection, loop for a fixed time. Each transaction does
"a few milliseconds of work" inside the open transaction: a ``SELECT`` and then a
``sleep`` of :data:`WORK_SECONDS`, standing in for loading an aggregate and deciding.
It also appends one event. The value is committed transactions/s with 8 outbox
writers using the append API (validation on). The baseline is 8 writers through the
``eventsourcing`` 9.5 ``PostgresApplicationRecorder``, in a fresh database of its own.
Ratio = outbox / eventsourcing; higher is better.

eventsourcing's public ``insert_events()`` opens and commits its own transaction, so an
app cannot put its work inside that transaction. The honest equivalent used here
replays the body of ``PostgresApplicationRecorder.insert_events`` inside a transaction
that also holds the work, on a connection from the recorder's own pool: pipeline
mode, ``_insert_events``, then ``_insert_stored_events`` (``SET LOCAL lock_timeout``,
``LOCK TABLE ... IN EXCLUSIVE MODE``, ``NOTIFY``, the ``unnest`` INSERT), a sync, and
``_fetch_ids_after_insert_events``. The table lock serializes writers only from the
append to the commit, so where the work sits decides the result:

- ``work_then_append`` (headline): the work comes first, and the lock covers only the
  insert and the commit. This is eventsourcing's best case.
- ``append_then_work`` (details): the event is appended first, the order
  docs/writing-events.md recommends for stream appends. The lock then covers the work
  too, and eventsourcing runs its writers one at a time.

The details also give both sides with a single writer, i.e. how each scales from 1 to
8 writers. On both sides every event is a new aggregate (a fresh id, version 1), so
there are no key conflicts, and every commit sends a NOTIFY (the outbox's comes from
its trigger). Each run is repeated ``scale.repetitions`` times, with the sides taking
turns to go first; the figure is the median of the rounds' rates, with their range
(bench/method.py), and the details pool them.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import psycopg
from eventsourcing.persistence import StoredEvent
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from bench.harness import SCHEMAS, Figure, Scale, Stack, order_payload, stopwatch
from bench.method import Samples
from relay import Outbox, SchemaFolder

BENCHMARK = "writes"
EVENT_TYPE = "demo.orders.OrderPlaced"
ES_TOPIC = "demo.orders:OrderPlaced"
PLAIN_INSERT = (
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s)"
)
ROUND_TX = 50  # transactions per side per round: short rounds, so noise bursts hit all sides
WARMUP_TX = 300  # per side, before the rounds
WRITERS = 8
WORK_SECONDS = 0.0025  # "a few ms of work" inside each concurrent transaction
# (order, writers): the headline pair, the 1-writer scaling point, the lock-covers-work case
WRITER_RUNS = (
    ("work_then_append", WRITERS),
    ("work_then_append", 1),
    ("append_then_work", WRITERS),
)

Conn = psycopg.Connection[Any]
Append = Callable[[Conn, int], None]  # appends event number i inside the open transaction
Transaction = Callable[[Conn, int], None]  # runs one whole transaction, numbered i


def run(stack: Stack, scale: Scale) -> list[Figure]:
    registry = SchemaFolder.from_dir(SCHEMAS)
    return [append_overhead(stack, scale, registry), concurrent_writers(stack, scale, registry)]


# --- figure 1: append API overhead ---------------------------------------------------


def append_overhead(stack: Stack, scale: Scale, registry: SchemaFolder) -> Figure:
    rounds = max(5000, scale.events // 20) // ROUND_TX  # 5,000 tx per side quick, 10,000 default
    sides: dict[str, Append] = {
        "api": _api_append(Outbox(registry)),
        "api_unvalidated": _api_append(Outbox(None)),
        "sql": _plain_insert,
    }
    us_per_tx: dict[str, list[float]] = {name: [] for name in sides}
    client_us: dict[str, list[float]] = {name: [] for name in sides}
    with psycopg.connect(stack.database("writes"), autocommit=True) as conn:
        numbers = iter(range(10**9))  # distinct aggregate ids across all rounds
        for append in sides.values():  # warm-up: prepared statements, caches
            _serial(conn, append, numbers, WARMUP_TX)
        names = list(sides)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate order
                seconds = _serial(conn, sides[name], numbers, ROUND_TX)
                us_per_tx[name].append(seconds / ROUND_TX * 1e6)
                # The client's own share: the same appends, without a commit each.
                seconds = _one_transaction(conn, sides[name], numbers, ROUND_TX)
                client_us[name].append(seconds / ROUND_TX * 1e6)
    return _overhead_figure(us_per_tx, client_us, scale.repetitions, fsync=stack.postgres.fsync)


def blocks(values: list[float], count: int) -> Samples:
    """The medians of ``count`` consecutive blocks of ``values`` (the last takes what is
    left over): short interleaved rounds grouped into repetitions."""
    count = min(count, len(values))
    size = len(values) // count
    return Samples(
        tuple(
            statistics.median(values[i * size : (i + 1) * size if i < count - 1 else None])
            for i in range(count)
        )
    )


def _overhead_figure(
    rounds: dict[str, list[float]],
    client_us: dict[str, list[float]],
    repetitions: int,
    *,
    fsync: bool,
) -> Figure:
    us = {name: statistics.median(values) for name, values in rounds.items()}
    paired = [a / b for a, b in zip(rounds["api"], rounds["sql"], strict=True)]
    figure = Figure.of(
        BENCHMARK,
        "append API time per 1-row transaction",
        blocks(rounds["api"], repetitions),
        "us/tx",
        blocks(rounds["sql"], repetitions),
        "plain INSERT via psycopg",
        "ratio<=1.15",
    )
    figure.value, figure.baseline = us["api"], us["sql"]  # the median of every round
    figure.details = {
        "transactions_per_side": len(rounds["api"]) * ROUND_TX,
        "rounds": len(rounds["api"]),
        "us_per_tx": {name: round(v, 1) for name, v in us.items()},
        "us_per_tx_quartiles": {
            name: [round(q, 1) for q in statistics.quantiles(values, n=4)]
            for name, values in rounds.items()
        },
        "tx_per_s": {name: round(1e6 / v) for name, v in us.items()},
        "ratio_unvalidated": round(us["api_unvalidated"] / us["sql"], 3),
        "ratio_median_of_rounds": round(statistics.median(paired), 3),
        "us_per_append_without_commit": {
            name: round(statistics.median(values), 1) for name, values in client_us.items()
        },
        "fsync": fsync,
    }
    return figure


def _api_append(outbox: Outbox) -> Append:
    def append(conn: Conn, i: int) -> None:
        outbox.append(
            conn,
            aggregate_type="order",
            aggregate_id=str(i),
            event_type=EVENT_TYPE,
            payload=order_payload(i),
        )

    return append


def _plain_insert(conn: Conn, i: int) -> None:
    conn.execute(PLAIN_INSERT, ("order", str(i), EVENT_TYPE, Jsonb(order_payload(i))))


def _serial(conn: Conn, append: Append, numbers: Iterator[int], count: int) -> float:
    """Seconds taken by ``count`` transactions of one append each, one after the other."""
    batch = [next(numbers) for _ in range(count)]
    with stopwatch() as elapsed:
        for i in batch:
            with conn.transaction():
                append(conn, i)
    return elapsed[0]


def _one_transaction(conn: Conn, append: Append, numbers: Iterator[int], count: int) -> float:
    """Seconds taken by ``count`` appends in one transaction (rolled back)."""
    batch = [next(numbers) for _ in range(count)]
    with conn.transaction(force_rollback=True), stopwatch() as elapsed:
        for i in batch:
            append(conn, i)
    return elapsed[0]


# --- figure 2: concurrent writers against eventsourcing ------------------------------


@dataclass(frozen=True)
class Rate:
    transactions: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.transactions / self.seconds

    def __add__(self, other: Rate) -> Rate:
        return Rate(self.transactions + other.transactions, self.seconds + other.seconds)


@dataclass(frozen=True)
class Side:
    """One way of writing: how a writer gets its connection, and its transaction."""

    name: str
    connect: Callable[[], AbstractContextManager[Conn]]
    transaction: Callable[[bool], Transaction]  # append_first -> transaction

    def drive(self, order: str, writers: int, seconds: float) -> Rate:
        return _drive(self.connect, self.transaction(order == "append_then_work"), writers, seconds)


def concurrent_writers(stack: Stack, scale: Scale, registry: SchemaFolder) -> Figure:
    seconds = min(1.5, max(0.75, scale.events / 120_000))  # per run: 0.75 s quick, 1.5 s default
    outbox_url = stack.database("writers")
    datastore = _es_datastore(stack.database("es"), stack.postgres.password)
    try:
        recorder = PostgresApplicationRecorder(datastore)
        recorder.create_table()
        outbox = Outbox(registry)
        sides = [
            Side(
                "outbox",
                lambda: psycopg.connect(outbox_url, autocommit=True),
                lambda first: _outbox_tx(outbox, append_first=first),
            ),
            Side(
                "es", datastore.get_connection, lambda first: _es_tx(recorder, append_first=first)
            ),
        ]
        runs: dict[str, list[Rate]] = {}
        # Rounds, with the sides taking turns to go first, so drift hits both alike.
        for r in range(scale.repetitions):
            for order, writers in WRITER_RUNS:
                for side in sides if r % 2 == 0 else sides[::-1]:
                    key = f"{side.name}_{order}_{writers}"
                    runs.setdefault(key, []).append(side.drive(order, writers, seconds))
    finally:
        datastore.close()
    return _writers_figure(runs, seconds)


def _writers_figure(runs: dict[str, list[Rate]], seconds: float) -> Figure:
    """The median of the rounds' rates, with their range; the details pool them."""
    rates = {name: sum(rounds[1:], rounds[0]) for name, rounds in runs.items()}
    per_s = {name: round(rate.per_second, 1) for name, rate in rates.items()}

    def ratio(a: str, b: str) -> float:
        return round(per_s[a] / per_s[b], 2)

    head = f"work_then_append_{WRITERS}"

    def per_round(name: str) -> Samples:
        return Samples(tuple(r.per_second for r in runs[name]))

    return Figure.of(
        BENCHMARK,
        f"{WRITERS} writers, {WORK_SECONDS * 1e3:g} ms work/tx (vs eventsourcing)",
        per_round(f"outbox_{head}"),
        "tx/s",
        per_round(f"es_{head}"),
        f"eventsourcing PostgresApplicationRecorder, {WRITERS} writers",
        None,
        {
            "tx_per_s": per_s,
            "outbox_scaling_1_to_8": ratio(f"outbox_{head}", "outbox_work_then_append_1"),
            "es_scaling_1_to_8": ratio(f"es_{head}", "es_work_then_append_1"),
            "ratio_append_then_work": ratio(
                f"outbox_append_then_work_{WRITERS}", f"es_append_then_work_{WRITERS}"
            ),
            "work_ms_per_tx": WORK_SECONDS * 1e3,
            "rounds": len(runs[f"outbox_{head}"]),
            "seconds_per_run": seconds,
            "transactions": {name: rate.transactions for name, rate in rates.items()},
            "tx_per_s_by_round": {
                name: [round(r.per_second) for r in rounds] for name, rounds in runs.items()
            },
        },
    )


def _work(conn: Conn) -> None:
    """The app's own part of the transaction: read something, then think."""
    conn.execute("SELECT count(*) FROM pg_class").fetchone()
    time.sleep(WORK_SECONDS)


def _outbox_tx(outbox: Outbox, *, append_first: bool) -> Transaction:
    def transaction(conn: Conn, i: int) -> None:
        with conn.transaction():
            if not append_first:
                _work(conn)
            outbox.append(
                conn,
                aggregate_type="order",
                aggregate_id=str(uuid4()),
                event_type=EVENT_TYPE,
                payload=order_payload(i),
            )
            if append_first:
                _work(conn)

    return transaction


def _es_tx(recorder: PostgresApplicationRecorder, *, append_first: bool) -> Transaction:
    def transaction(conn: Conn, i: int) -> None:
        state = json.dumps(order_payload(i)).encode()
        events = [StoredEvent(uuid4(), 1, ES_TOPIC, state)]
        with conn.transaction():
            if not append_first:
                _work(conn)
            _es_insert(recorder, conn, events)
            if append_first:
                _work(conn)

    return transaction


def _es_insert(
    recorder: PostgresApplicationRecorder, conn: Conn, events: list[StoredEvent]
) -> None:
    """The body of ``PostgresApplicationRecorder.insert_events``, minus its own transaction.

    Private methods, because the public one owns the transaction and the point is to
    measure the work inside it. ``_insert_events`` is the recorder's hook for extra rows
    (a no-op here); ``_insert_stored_events`` locks the table, NOTIFYs and inserts.
    """
    with conn.pipeline() as pipeline:
        with conn.cursor() as curs:
            recorder._insert_events(curs, events)
        with conn.cursor() as curs:
            recorder._insert_stored_events(curs, events)  # LOCK TABLE ... IN EXCLUSIVE MODE
            pipeline.sync()
            recorder._fetch_ids_after_insert_events(curs, events)


def _es_datastore(url: str, password: str) -> PostgresDatastore:
    # The URL names the local server's password file, which the datastore cannot read.
    params = conninfo_to_dict(url)
    return PostgresDatastore(
        dbname=str(params["dbname"]),
        host=str(params["host"]),
        port=str(params["port"]),
        user=str(params["user"]),
        password=password,
        pool_size=WRITERS,  # one connection per writer, as on the outbox side
    )


def _drive(
    connect: Callable[[], AbstractContextManager[Conn]],
    transaction: Transaction,
    writers: int,
    seconds: float,
) -> Rate:
    """``writers`` threads run ``transaction`` until ``seconds`` after they all connected."""
    clock = [0.0, 0.0]  # start, deadline: set once every writer is connected

    def release() -> None:
        clock[0] = time.perf_counter()
        clock[1] = clock[0] + seconds

    ready = threading.Barrier(writers, action=release)

    def writer(k: int) -> int:
        try:
            with connect() as conn:
                ready.wait()
                done = 0
                while time.perf_counter() < clock[1]:
                    transaction(conn, k * 10**9 + done)
                    done += 1
                return done
        except BaseException:
            ready.abort()  # don't leave the others waiting for a writer that failed
            raise

    with ThreadPoolExecutor(writers) as pool:
        futures = [pool.submit(writer, k) for k in range(writers)]
        counts = _results(futures)
        elapsed = time.perf_counter() - clock[0]  # includes each writer's last transaction
    return Rate(sum(counts), elapsed)


def _results(futures: list[Future[int]]) -> list[int]:
    """Every writer's count, or the first real error (not a broken barrier) if any failed."""
    wait(futures)
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))
    return [f.result() for f in futures]
