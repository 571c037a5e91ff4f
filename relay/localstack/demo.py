"""``outbox-relay dev``: the local stack with a demo writer and live figures.

Starts a local Postgres and a local Apache Kafka (both keep their data in ``workdir``),
applies the migrations, runs the relay in-process, writes demo events (some in
transactions rolled back on purpose) and reads them back with a ``read_committed``
consumer, showing throughput, commit→visible latency, duplicates and rolled-back leaks.
"""

from __future__ import annotations

import json
import logging
import random
import shlex
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from relay import wiring
from relay.adapters.postgres import db
from relay.core.log_fields import log_extra
from relay.core.model import HEADER_EVENT_TYPE, ConsumedRecord
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings, load_settings
from relay.core.terminal import printable
from relay.daemon import Relay
from relay.errors import RelayError, SchemaError
from relay.localstack import KAFKA_VERSION, LocalKafka, LocalPostgres, free_port
from relay.localstack.stack import migrated_database
from relay.ops.lag import subscriber_statuses
from relay.write.outbox import Outbox

logger = logging.getLogger(__name__)

DEMO_DATABASE = "outbox_demo"
DEMO_TOPICS = ("outbox.event.order", "outbox.event.customer")
ROLLBACK_SHARE = 0.05  # of demo transactions, rolled back on purpose
LATENCY_WINDOW = 1000  # samples behind the live p50/p99
RATE_WINDOW_S = 5.0  # published events/s is measured over this many seconds
END_OFFSETS_TIMEOUT_S = 60.0  # a restarted broker's partitions answering again
DRAIN_TIMEOUT_S = 5.0  # at shutdown, wait this long for committed events to arrive
REFRESH_S = 0.5
# Off a terminal, a plain line of figures this often.
PLAIN_EVERY_S = 5.0
RECENT = 5
_CARRIERS = ("DHL", "UPS", "FedEx", "GLS", "PostNL")

SigHandler = Callable[[int, FrameType | None], Any] | int | None


# --------------------------------------------------------------------------- shared figures


@dataclass
class Transactions:
    """Demo transactions the writer ended one way (committed or rolled back), and the
    events in them."""

    transactions: int = 0
    events: int = 0

    def add(self, ids: list[str]) -> None:
        self.transactions += 1
        self.events += len(ids)


@dataclass
class Tally:
    """Figures shared by the writer, the consumer and the live view (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    committed: Transactions = field(default_factory=Transactions)
    rolled_back: Transactions = field(default_factory=Transactions)
    consumed: int = 0
    # Where this run began on each demo topic partition: records below are an earlier
    # run's, read again from the start of the log, and not this run's to count.
    since: dict[tuple[str, int], int] = field(default_factory=dict)
    duplicates: int = 0
    leaks: int = 0
    writer_error: str | None = None
    commit_times: dict[str, float] = field(default_factory=dict)  # committed, not yet consumed
    rolled_back_ids: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)
    early: dict[str, float] = field(default_factory=dict)  # consumed before commit was recorded
    recent_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    latencies: list[float] = field(default_factory=list)
    recent: deque[ConsumedRecord] = field(default_factory=lambda: deque(maxlen=RECENT))

    def record_commit(self, ids: list[str], committed_at: float) -> None:
        with self.lock:
            self.committed.add(ids)
            for message_id in ids:
                seen_at = self.early.pop(message_id, None)
                if seen_at is None:
                    self.commit_times[message_id] = committed_at
                else:
                    self._latency(max(0.0, seen_at - committed_at))

    def record_rollback(self, ids: list[str]) -> None:
        with self.lock:
            self.rolled_back.add(ids)
            self.rolled_back_ids.update(ids)
            self.leaks += sum(1 for message_id in ids if message_id in self.seen)

    def record_consumed(self, record: ConsumedRecord, seen_at: float) -> None:
        message_id = record.message_id or ""
        with self.lock:
            if record.offset < self.since.get((record.topic, record.partition), 0):
                return
            self.consumed += 1
            self.recent.append(record)
            if message_id in self.seen:
                self.duplicates += 1
                return
            self.seen.add(message_id)
            if message_id in self.rolled_back_ids:
                self.leaks += 1
                return
            committed_at = self.commit_times.pop(message_id, None)
            if committed_at is None:
                self.early[message_id] = seen_at  # or an event of an earlier run
            else:
                self._latency(seen_at - committed_at)

    def unconsumed(self) -> int:
        with self.lock:
            return len(self.commit_times)

    def _latency(self, seconds: float) -> None:
        self.recent_latencies.append(seconds)
        self.latencies.append(seconds)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


# --------------------------------------------------------------------------- demo writer


class DemoEvent(NamedTuple):
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: dict[str, Any]


class DemoData:
    """Plausible orders and customers; ids of rolled-back transactions are forgotten."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._serial = 0
        self._customers: list[str] = []
        self._open_orders: deque[str] = deque(maxlen=10_000)
        self._new_customers: list[str] = []
        self._new_orders: list[str] = []

    def event(self) -> DemoEvent:
        roll = self._rng.random()
        if roll < 0.2 or not (self._customers or self._new_customers):
            return self._customer()
        if roll < 0.45 and self._open_orders:
            order_id = self._open_orders.popleft()
            payload = {"order_id": order_id, "carrier": self._rng.choice(_CARRIERS)}
            return DemoEvent("order", order_id, "OrderShipped", payload)
        return self._order()

    def commit(self) -> None:
        self._customers.extend(self._new_customers)
        self._open_orders.extend(self._new_orders)
        self.rollback()

    def rollback(self) -> None:
        self._new_customers.clear()
        self._new_orders.clear()

    def _next_id(self, prefix: str) -> str:
        self._serial += 1
        return f"{prefix}-{self._serial}"

    def _customer(self) -> DemoEvent:
        customer_id = self._next_id("c")
        self._new_customers.append(customer_id)
        payload = {"customer_id": customer_id, "email": f"{customer_id}@example.com"}
        return DemoEvent("customer", customer_id, "CustomerRegistered", payload)

    def _order(self) -> DemoEvent:
        order_id = self._next_id("o")
        self._new_orders.append(order_id)
        payload = {
            "order_id": order_id,
            "customer_id": self._rng.choice(self._customers or self._new_customers),
            "amount_cents": self._rng.randint(100, 50_000),
            "currency": "EUR",
            "note": None,
        }
        return DemoEvent("order", order_id, "OrderPlaced", payload)


class _StoppableThread(threading.Thread):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._stopping = threading.Event()

    def close(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self.ident is not None:
            self.join(timeout)


class DemoWriter(_StoppableThread):
    """Writes transactions of 1-3 events at ``rate`` events/s (0: as fast as it can)."""

    def __init__(self, database_url: str, outbox: Outbox, tally: Tally, rate: float) -> None:
        super().__init__("demo-writer")
        self._url = database_url
        self._outbox = outbox
        self._tally = tally
        self._rate = rate
        self._rng = random.Random()
        self._data = DemoData(self._rng)

    def run(self) -> None:
        try:
            with db.connect(self._url, application_name="outbox-relay-demo-writer") as conn:
                self._loop(conn)
        except Exception as exc:
            logger.exception("demo writer failed", extra=log_extra("demo_writer_failed"))
            with self._tally.lock:
                self._tally.writer_error = str(exc)

    def _loop(self, conn: psycopg.Connection[Any]) -> None:
        due = time.monotonic()
        while not self._stopping.is_set():
            written = self._transaction(conn)
            if self._rate > 0:
                due = self._pace(due + written / self._rate)

    def _pace(self, due: float) -> float:
        """Sleep until ``due``; after a stall, do not burst to catch up."""
        now = time.monotonic()
        if due < now - 1.0:
            return now
        if due > now:
            self._stopping.wait(due - now)
        return due

    def _transaction(self, conn: psycopg.Connection[Any]) -> int:
        events = [self._data.event() for _ in range(self._rng.randint(1, 3))]
        roll_back = self._rng.random() < ROLLBACK_SHARE
        ids: list[str] = []
        with conn.transaction() as tx:
            for event in events:
                ids.append(str(self._append(conn, event)))
            if roll_back:
                raise psycopg.Rollback(tx)
        committed_at = time.monotonic()
        if roll_back:
            self._data.rollback()
            self._tally.record_rollback(ids)
        else:
            self._data.commit()
            self._tally.record_commit(ids, committed_at)
        return len(events)

    def _append(self, conn: psycopg.Connection[Any], event: DemoEvent) -> object:
        return self._outbox.append(
            conn,
            aggregate_type=event.aggregate_type,
            aggregate_id=event.aggregate_id,
            event_type=event.event_type,
            payload=event.payload,
        )


# --------------------------------------------------------------------------- demo consumer


class DemoConsumer(_StoppableThread):
    """Reads every partition of the demo topics (``read_committed``) as they appear."""

    def __init__(self, bootstrap_servers: str, tally: Tally) -> None:
        super().__init__("demo-consumer")
        # fetch.wait.max.ms: the broker answers within 10 ms, for the latency figures.
        config = {"bootstrap.servers": bootstrap_servers, "fetch.wait.max.ms": 10}
        self._reader = wiring.topic_reader(config, group="outbox-relay-dev")
        self._tally = tally

    def run(self) -> None:
        try:
            with closing(self._reader.follow(DEMO_TOPICS, idle=0.1)) as records:
                for record in records:
                    if self._stopping.is_set():
                        return
                    if record is not None:
                        self._tally.record_consumed(record, time.monotonic())
        except Exception:
            logger.exception("demo consumer failed", extra=log_extra("demo_consumer_failed"))


# --------------------------------------------------------------------------- live view


class Dashboard:
    """Renders the live table; tracks the recent published rate."""

    def __init__(self, demo: DemoRun) -> None:
        self._demo = demo
        self._samples: deque[tuple[float, int]] = deque()

    def render(self) -> Group:
        figures, recent = self._figures()
        return Group(_figures_table(figures), _recent_table(recent))

    def line(self) -> str:
        """The figures on one plain line: what the demo prints off a terminal, where a
        live table is drawn only once, at the end."""
        figures, _ = self._figures()
        return "; ".join(f"{name} {value}" for name, value in figures if name != "rolled back")

    def _figures(self) -> tuple[list[tuple[str, str]], list[tuple[str, str, str, str]]]:
        s = self._demo
        published = s.published()
        rate = self._rate(time.monotonic(), published)
        with s.tally.lock:
            t = s.tally
            latencies = list(t.recent_latencies)
            recent = [_shown(r, s.options.registry) for r in t.recent]
            figures = [
                (
                    "written",
                    f"{t.committed.events} events in {t.committed.transactions} transactions",
                ),
                (
                    "rolled back",
                    f"{t.rolled_back.events} events in {t.rolled_back.transactions} "
                    "transactions (never published)",
                ),
                ("published", f"{published}  ({rate:.0f} events/s, last {RATE_WINDOW_S:.0f} s)"),
                ("consumed", f"{t.consumed}  ({t.duplicates} duplicates, {t.leaks} leaks)"),
                ("lag", f"{s.lag(published)} events written, not yet published"),
            ]
        p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
        figures.append(("latency", f"p50 {_ms(p50)}, p99 {_ms(p99)}  (commit → consumer)"))
        figures.append(("relay", s.relay_state()))
        return figures, recent

    def _rate(self, now: float, published: int) -> float:
        self._samples.append((now, published))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        then, before = self._samples[0]
        return (published - before) / (now - then) if now > then else 0.0


def _figures_table(figures: list[tuple[str, str]]) -> Table:
    table = Table(box=box.SIMPLE, show_header=False, title="outbox-relay dev", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in figures:
        table.add_row(name, value)
    return table


def _shown(record: ConsumedRecord, registry: SchemaFolder) -> tuple[str, str, str, str]:
    """A consumed record as the live view shows it: topic, key, event type, payload."""
    key = (record.key or b"").decode(errors="replace")
    return (
        record.topic,
        key,
        record.header_text(HEADER_EVENT_TYPE) or "?",
        _payload(record, registry),
    )


def _payload(record: ConsumedRecord, registry: SchemaFolder) -> str:
    try:
        _schema, payload = registry.decode(record.value or b"")
    except (SchemaError, ValueError, EOFError) as exc:
        return f"<not decodable: {exc}>"
    text = json.dumps(payload, separators=(",", ":"), default=str)
    return text if len(text) <= 70 else text[:67] + "..."


def _recent_table(recent: list[tuple[str, str, str, str]]) -> Table:
    table = Table("topic", "key", "event", "payload", box=box.SIMPLE, title="last consumed")
    for row in reversed(recent):
        # Consumed data, whoever wrote it: plain text, never rich markup nor a control
        # character the terminal would obey.
        table.add_row(*(Text(printable(field)) for field in row))
    return table


# --------------------------------------------------------------------------- the stack


@dataclass(frozen=True)
class DevOptions:
    workdir: Path
    schemas_dir: Path
    registry: SchemaFolder
    rate: float
    duration: float | None


@dataclass
class DemoRun:
    """What one ``dev`` run started, and when."""

    options: DevOptions
    console: Console
    tally: Tally = field(default_factory=Tally)
    postgres: LocalPostgres | None = None
    broker: LocalKafka | None = None
    relay: Relay | None = None
    database_url: str = ""
    backlog: int = 0  # events already waiting in the outbox when we started
    started_at: float | None = None  # relay running
    stopped_at: float | None = None  # relay stopped

    def published(self) -> int:
        total = 0
        for worker in list(self.relay.workers.values()) if self.relay else []:
            with worker.stats.lock:
                total += worker.stats.published
        return total

    def lag(self, published: int) -> int:
        return max(0, self.tally.committed.events + self.backlog - published)

    def relay_state(self) -> str:
        parts = []
        for name, worker in list(self.relay.workers.items()) if self.relay else []:
            error = f" ({worker.stats.last_error})" if worker.stats.last_error else ""
            parts.append(f"{name}: {worker.stats.state}{error}")
        if self.tally.writer_error:
            parts.append(f"writer failed: {self.tally.writer_error}")
        return "; ".join(parts) or "starting"


def run_dev(*, workdir: Path, rate: float, duration: float | None, schemas_dir: Path) -> None:
    """Run the embedded stack until Ctrl-C or ``duration`` seconds after it is up."""
    registry = SchemaFolder.from_dir(schemas_dir)  # fail before starting anything
    options = DevOptions(workdir, schemas_dir, registry, rate, duration)
    demo = DemoRun(options, Console())
    # SIGTERM (a process manager, `timeout`, `kill`) stops the demo as Ctrl-C does: in
    # order, with the summary, and leaving no temporary files behind.
    previous = _set_signal(signal.SIGTERM, _interrupt)
    try:
        _run(demo)
    except KeyboardInterrupt:
        demo.console.print("interrupted; everything is stopped")
    finally:
        _set_signal(signal.SIGTERM, previous)
    if demo.started_at is not None:
        _summary(demo)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _set_signal(which: int, handler: Any) -> Any:
    if threading.current_thread() is threading.main_thread() and handler is not None:
        return signal.signal(which, handler)
    return None


def _run(demo: DemoRun) -> None:
    with ExitStack() as stack:
        stack.callback(_set_sigint, signal.getsignal(signal.SIGINT))  # runs last
        try:
            _start(stack, demo)
            _banner(demo)
            _watch(demo, demo.options.duration)
        finally:
            # A second Ctrl-C (or SIGTERM) must not cut the ordered shutdown short.
            _set_sigint(signal.SIG_IGN)
            _set_signal(signal.SIGTERM, signal.SIG_IGN)


def _set_sigint(handler: SigHandler) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


def _start(stack: ExitStack, demo: DemoRun) -> None:
    """Start everything, registering each stop before its start (unwound in reverse).

    Servers are started from this (the main) thread: their parent-death signal is
    tied to the thread that spawned them.
    """
    options = demo.options
    demo.postgres = LocalPostgres(options.workdir / "pg", port=free_port(), fsync=False)
    stack.callback(demo.postgres.stop)
    demo.postgres.start()
    demo.broker = LocalKafka(options.workdir / "kafka")
    stack.callback(demo.broker.stop)
    demo.broker.start()
    demo.database_url, demo.backlog = _prepare_database(demo.postgres)
    settings = load_settings(
        database_url=demo.database_url,
        bootstrap_servers=demo.broker.bootstrap_servers,
        schemas_dir=options.schemas_dir,
        poll_interval=1.0,
        metrics_port=0,  # any free port: the demo must not fail on a busy 9187
    )
    _create_demo_topics(settings)
    demo.tally.since = _end_offsets(  # before the relay starts
        demo.broker.bootstrap_servers, settings.topic_partitions
    )
    consumer = DemoConsumer(demo.broker.bootstrap_servers, demo.tally)
    stack.callback(consumer.close)
    consumer.start()
    _start_relay(stack, demo, settings)
    writer = DemoWriter(demo.database_url, Outbox(options.registry), demo.tally, options.rate)
    stack.callback(_drain, demo)
    stack.callback(writer.close)
    writer.start()


def _create_demo_topics(settings: Settings) -> None:
    """Create the demo topics as the relay would (same partitions), so the consumer is
    assigned before the first event arrives (no consumer warm-up in the latencies), and
    record them as the outbox's: the default subscriber's rows publish only to topics
    the outbox created (docs/design.md §7, "Rows name topics")."""
    url = settings.require_database_url()
    record = wiring.topic_record(
        lambda: db.connect(url, application_name="outbox-relay-dev"), settings.database_schema
    )
    topics = wiring.topic_creator(settings, record)
    try:
        topics.ensure(set(DEMO_TOPICS))
    except RelayError as exc:  # the relay creates them on first use, then
        logger.info(
            "demo topics not created up front: %s",
            exc,
            extra=log_extra("demo_topics_not_created", error=exc),
        )


def _end_offsets(bootstrap_servers: str, partitions: int) -> dict[tuple[str, int], int]:
    """Each demo topic partition's end: what an earlier run left there.

    Asked until every partition answers: a broker just restarted on an old log lists
    its topics before their leaders are back, and a partition left out would count the
    earlier run's records as this run's.
    """
    deadline = time.monotonic() + END_OFFSETS_TIMEOUT_S
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "outbox-relay-dev"})
    try:
        while True:
            try:
                return _read_end_offsets(consumer, partitions)
            except (KafkaException, LookupError) as exc:
                if time.monotonic() >= deadline:  # then every record counts, and it says so
                    logger.warning(
                        "demo topics' offsets unknown, the summary counts earlier runs' "
                        "records too: %s",
                        exc,
                        extra=log_extra("demo_offsets_unknown", error=exc),
                    )
                    return {}
                time.sleep(0.5)
    finally:
        consumer.close()


def _read_end_offsets(consumer: Consumer, partitions: int) -> dict[tuple[str, int], int]:
    topics = consumer.list_topics(timeout=10).topics
    ends = {}
    for topic in DEMO_TOPICS:
        found = topics[topic].partitions if topic in topics else {}
        if topic in topics and len(found) < partitions:
            raise LookupError(f"{topic} lists {len(found)} of its {partitions} partitions")
        for partition in found:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            ends[(topic, partition)] = high
    return ends


def _start_relay(stack: ExitStack, demo: DemoRun, settings: Settings) -> None:
    relay = demo.relay = Relay(settings, registry=demo.options.registry)

    def stop() -> None:
        relay.stop()
        if demo.started_at is not None:
            demo.stopped_at = time.monotonic()

    stack.callback(stop)
    relay.start()
    demo.started_at = time.monotonic()


def _prepare_database(postgres: LocalPostgres) -> tuple[str, int]:
    """Create the demo database if needed and migrate it; returns its URL and backlog."""
    url = migrated_database(postgres, DEMO_DATABASE, application_name="outbox-relay-dev")
    with db.connect(url, application_name="outbox-relay-dev") as conn:
        backlog = sum(s.lag.events for s in subscriber_statuses(wiring.store_on(conn), skips=False))
    return url, backlog


def _drain(demo: DemoRun) -> None:
    """Give the relay a moment to publish what the writer committed last."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while demo.tally.unconsumed() and time.monotonic() < deadline:
        time.sleep(0.05)


def _banner(demo: DemoRun) -> None:
    assert demo.broker is not None and demo.postgres is not None
    console = demo.console
    console.print(
        "[bold]outbox-relay dev[/bold]: local Postgres + Apache Kafka, relay, demo writer"
    )
    # Quoted: the URL's "?" would be a glob to the shell it is pasted into.
    console.print(
        f"  postgres   psql {shlex.quote(demo.database_url)}", soft_wrap=True, highlight=False
    )
    console.print(
        f"  kafka      Apache Kafka {KAFKA_VERSION}, bootstrap servers "
        f"{demo.broker.bootstrap_servers}, topics {', '.join(DEMO_TOPICS)}, "
        f"started in {demo.broker.startup_seconds or 0:.1f} s",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        f"  data       {demo.postgres.data_dir} (log {demo.postgres.log_path}), "
        f"{demo.broker.work_dir} (log {demo.broker.log_path})",
        soft_wrap=True,
        highlight=False,
    )
    console.print("  Ctrl-C stops everything.", highlight=False)


def _watch(demo: DemoRun, duration: float | None) -> None:
    dashboard = Dashboard(demo)
    deadline = None if duration is None else time.monotonic() + duration
    if not demo.console.is_terminal:
        _print_lines(demo, dashboard, deadline)
        return
    try:
        with Live(dashboard.render(), console=demo.console, auto_refresh=False) as live:
            while deadline is None or time.monotonic() < deadline:
                remaining = REFRESH_S if deadline is None else deadline - time.monotonic()
                time.sleep(max(0.0, min(REFRESH_S, remaining)))
                live.update(dashboard.render(), refresh=True)
    finally:
        if not demo.console.is_terminal:
            demo.console.line()  # Live ends its final render with a newline on terminals only


def _print_lines(demo: DemoRun, dashboard: Dashboard, deadline: float | None) -> None:
    """Off a terminal (a pipe, a log file, CI): a plain line every few seconds, as it
    happens, rather than one table at the end."""
    started = time.monotonic()
    while deadline is None or time.monotonic() < deadline:
        remaining = PLAIN_EVERY_S if deadline is None else deadline - time.monotonic()
        time.sleep(max(0.0, min(PLAIN_EVERY_S, remaining)))
        demo.console.print(
            f"{time.monotonic() - started:5.0f} s  {dashboard.line()}",
            soft_wrap=True,
            highlight=False,
        )
        demo.console.file.flush()


def _summary(demo: DemoRun) -> None:
    demo.console.print()
    t = demo.tally
    published = demo.published()
    end = demo.stopped_at or time.monotonic()
    elapsed = max(1e-9, end - (demo.started_at or end))
    p50, p99 = percentile(t.latencies, 0.50), percentile(t.latencies, 0.99)
    recent = list(t.recent_latencies)
    r50, r99 = percentile(recent, 0.50), percentile(recent, 0.99)
    demo.console.print(
        f"Summary: ran {elapsed:.1f} s. Wrote {t.committed.events} events in "
        f"{t.committed.transactions} transactions; rolled back {t.rolled_back.transactions} "
        f"transactions ({t.rolled_back.events} events) on purpose. Published {published} events "
        f"({published / elapsed:.0f} events/s on average), consumed {t.consumed}, "
        f"{t.duplicates} duplicates, {t.leaks} rolled-back leaks, "
        f"{demo.lag(published)} unpublished at exit. Commit-to-consumer latency "
        f"p50 {_ms(p50)}, p99 {_ms(p99)} over all {len(t.latencies)} samples "
        f"(last {len(recent)}: p50 {_ms(r50)}, p99 {_ms(r99)}).",
        soft_wrap=True,
        highlight=False,
    )
