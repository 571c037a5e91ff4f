"""Prometheus ``/metrics``, and ``/healthz`` / ``/readyz`` for orchestrators.

Counters are collected at scrape time from the workers' statistics (plus the totals of
workers that have stopped, so counters never go down). Lag, checkpoint age, horizon and
claims come from Postgres, read in a background thread at most once per
``metrics_cache_ttl`` seconds: a scrape waits for a read at most FRESH_WAIT_S, then
serves the last figures, with their age. The probes are served by threads of their own,
never behind scrapes. The hot path is not instrumented.

* ``/healthz`` (liveness): the relay's threads are alive. A relay that only waits for
  Postgres or Kafka is healthy: restarting it would not help.
* ``/readyz`` (readiness): the relay holds a session, which it opens only while Kafka
  answers, and its heartbeats to Postgres renewed it within the session timeout (less
  one heartbeat interval). A halted part, or one waiting for the schema registry, leaves
  it ready (``Relay.ready`` says why).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from waitress.server import create_server  # type: ignore[import-untyped]
from waitress.task import ThreadedTaskDispatcher  # type: ignore[import-untyped]

from relay.adapters.postgres.store import OutboxStore
from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.settings import Settings
from relay.engine.worker import COUNTERS as _COUNTERS  # the workers' counters, declared there
from relay.errors import ConfigError, RelayError
from relay.observability import tracing
from relay.ops.lag import EXACT_UP_TO, subscriber_statuses

if TYPE_CHECKING:
    from wsgiref.types import StartResponse

logger = logging.getLogger(__name__)


def _latency_histogram(totals: dict[PartId, Counter[str]]) -> Metric:
    """Commit→visible latency per part, from the buckets its workers counted
    (relay/observability/tracing.py says where "commit" comes from)."""
    family = HistogramMetricFamily(
        "outbox_relay_commit_to_visible_seconds",
        "Seconds from an event's commit (its occurred_at: the writer's transaction start, "
        "unless the writer set it) to its batch's Kafka commit",
        labels=["subscriber", "part"],
    )
    bounds = [*(str(b) for b in tracing.LATENCY_BUCKETS), "+Inf"]
    for part, stats in sorted(totals.items()):
        cumulative, buckets = 0.0, []
        for bound in bounds:
            cumulative += stats.get(f"{tracing.LATENCY_KEY}_le_{bound}", 0)
            buckets.append((bound, cumulative))
        family.add_metric(
            [part.subscriber, str(part.part)],
            buckets,
            sum_value=stats.get(tracing.SUM_KEY, 0) / 1e6,
        )
    return family


class RelayView(Protocol):
    """What the endpoints read of a relay: one process (``Relay``) or several
    (``RelayProcesses``)."""

    def healthy(self) -> tuple[bool, str]: ...

    def ready(self) -> tuple[bool, str]: ...

    def part_totals(self) -> dict[PartId, Counter[str]]: ...

    def part_states(self) -> dict[PartId, str]: ...

    def part_waits(self) -> dict[PartId, str]: ...

    def key_space_changes(self) -> Counter[str]: ...

    def retention_totals(self) -> Counter[str]: ...


class RelayCollector(Collector):
    """Reads the relay's state when Prometheus scrapes.

    The counters are read live (they are in memory). The figures from Postgres come
    from :class:`DatabaseFigures`, which reads them in a background thread: a scrape
    never waits on the database for longer than ``FRESH_WAIT_S``, and serves the last
    figures read, with their age (``outbox_relay_database_metrics_age_seconds``).
    """

    def __init__(
        self, relay: RelayView, open_store: Callable[[], OutboxStore], ttl: float = 0.0
    ) -> None:
        self._relay = relay
        self.database = DatabaseFigures(open_store, ttl)

    def collect(self) -> Iterator[Metric]:
        yield from self._counters()
        figures, read_at = self.database.latest()
        yield from figures
        yield GaugeMetricFamily(
            "outbox_relay_database_metrics_age_seconds",
            "Seconds since the figures from Postgres (lag, checkpoint age, claims, "
            "horizon, sessions) were last read; +Inf before the first read",
            value=math.inf if read_at is None else time.monotonic() - read_at,
        )

    def _counters(self) -> Iterator[Metric]:
        totals = self._relay.part_totals()
        for field, (name, doc) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["subscriber", "part"])
            for part, stats in sorted(totals.items()):
                family.add_metric([part.subscriber, str(part.part)], stats.get(field, 0))
            yield family
        yield _latency_histogram(totals)
        state = GaugeMetricFamily(
            "outbox_relay_part_state",
            "1 for the state each part this relay runs is in",
            labels=["subscriber", "part", "state"],
        )
        for part, worker_state in sorted(self._relay.part_states().items()):
            state.add_metric([part.subscriber, str(part.part), worker_state], 1)
        yield state
        waiting = GaugeMetricFamily(
            "outbox_relay_part_waiting",
            "1 while a part waits to retry because a service it needs could not be reached "
            "(service: schema_registry, kafka or postgres); it publishes nothing meanwhile, "
            "and dead-letters nothing for it",
            labels=["subscriber", "part", "service"],
        )
        for part, service in sorted(self._relay.part_waits().items()):
            waiting.add_metric([part.subscriber, str(part.part), service], 1)
        yield waiting
        moves = CounterMetricFamily(
            "outbox_relay_key_space_changes",
            "Database moves this relay found: 'rebased' (keys rewritten below the new "
            "cluster's transaction ids) or 'continued' (new cluster, same id space)",
            labels=["action"],
        )
        for action, count in sorted(self._relay.key_space_changes().items()):
            moves.add_metric([action], count)
        yield moves
        retention = self._relay.retention_totals()
        yield CounterMetricFamily(
            "outbox_relay_pruned_events",
            "Published rows deleted by retention",
            value=retention["pruned"],
        )
        yield CounterMetricFamily(
            "outbox_relay_pruned_dead_letters",
            "Dead letters deleted by retention (redriven, or past dead_letter_retention)",
            value=retention["dead_letters_pruned"],
        )
        yield CounterMetricFamily(
            "outbox_relay_prune_failures",
            "Retention passes that failed (the rows are kept until a pass succeeds)",
            value=retention["failures"],
        )


# How long a scrape waits for the read of Postgres it started (or found running) before
# it serves the figures of the last read. Under Prometheus's default scrape timeout
# (10 s); the read itself is bounded by the connection's statement and lock timeouts.
FRESH_WAIT_S = 5.0


class DatabaseFigures:
    """The figures from Postgres, read by one background thread at a time.

    A scrape starts a read when the last one began ``ttl`` seconds ago or more, waits for
    it at most FRESH_WAIT_S, and gets the figures of the last read that succeeded. So a
    storm of scrapes costs one read per ``ttl`` (a failed read counts too: a storm
    against a down database must not become a storm of connections), and a locked
    table or a slow database delays a scrape by FRESH_WAIT_S at most.
    """

    def __init__(self, open_store: Callable[[], OutboxStore], ttl: float) -> None:
        self._open_store = open_store
        self._ttl = ttl
        self._lock = threading.Lock()
        self._store: OutboxStore | None = None  # used by the reading thread only
        self._figures: list[Metric] = []
        self._read_at: float | None = None  # monotonic time of the last good read
        self._started_at: float | None = None
        self._done = threading.Event()
        self._reader: threading.Thread | None = None
        self._closed = False

    def latest(self) -> tuple[list[Metric], float | None]:
        """The last figures read and when (monotonic), after a fresh read if one is due
        and finishes within FRESH_WAIT_S."""
        with self._lock:
            now = time.monotonic()
            due = self._started_at is None or now - self._started_at >= self._ttl
            if due and not self._closed and (self._reader is None or not self._reader.is_alive()):
                self._started_at = now
                self._done = threading.Event()
                self._reader = threading.Thread(
                    target=self._read, args=(self._done,), name="relay-metrics-db", daemon=True
                )
                self._reader.start()
            done = self._done
        done.wait(FRESH_WAIT_S)
        with self._lock:
            return self._figures, self._read_at

    def close(self) -> None:
        """Close the connection (now, or when the read under way ends)."""
        with self._lock:
            self._closed = True
            reading = self._reader is not None and self._reader.is_alive()
        if not reading:
            self._disconnect()

    def _read(self, done: threading.Event) -> None:
        try:
            figures = self._read_or_none()
            with self._lock:
                if figures is not None:
                    self._figures, self._read_at = figures, time.monotonic()
                closed = self._closed
            if closed:
                self._disconnect()
        finally:
            done.set()

    def _read_or_none(self) -> list[Metric] | None:
        try:
            if self._store is None or self._store.closed:
                self._store = self._open_store()
            return list(_database(self._store))
        except RelayError as exc:
            logger.warning(
                "metrics: cannot read Postgres (serving the last figures read): %s",
                exc,
                extra=log_extra("metrics_db_unreadable", error=exc),
            )
            self._disconnect()
            return None

    def _disconnect(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()


def _database(store: OutboxStore) -> Iterator[Metric]:
    gauges = [
        GaugeMetricFamily(name, help_text, labels=["subscriber", "part"])
        for name, help_text in _PART_GAUGES
    ]
    now = time.time()
    for subscriber in subscriber_statuses(store):
        for p in subscriber.parts:
            labels = [p.state.name, str(p.state.part)]
            checkpoint_age = max(0.0, now - p.state.updated_at.timestamp())
            values = (
                p.lag.events,
                p.lag.seconds,
                checkpoint_age,
                1 if p.state.owner is not None else 0,
                0 if p.state.halted_error is None else 1,
                _stalled_for(p.lag.events, p.lag.seconds, checkpoint_age),
            )
            for gauge, value in zip(gauges, values, strict=True):
                gauge.add_metric(labels, value)
    yield from gauges
    sees_all = store.sees_all_backends()
    yield GaugeMetricFamily(
        "outbox_relay_horizon_visible",
        "1 when the relay's role sees every session's transaction (pg_read_all_stats); "
        "0: outbox_relay_horizon_held_seconds is left out",
        value=1 if sees_all else 0,
    )
    if sees_all:  # else a 0 would only mean 'none of my own role's sessions'
        ages = [h.age_s for h in store.horizon_holders() if h.age_s is not None]
        yield GaugeMetricFamily(
            "outbox_relay_horizon_held_seconds",
            "Age of the oldest open transaction holding back publication",
            value=max(ages, default=0.0),
        )
    yield GaugeMetricFamily(
        "outbox_relay_live_sessions",
        "Relay sessions alive in this database",
        value=len(store.live_sessions()),
    )


# Per subscriber part, in the order _database computes their values.
_PART_GAUGES = (
    (
        "outbox_relay_lag_events",
        f"Events not yet published (counted up to {EXACT_UP_TO}, estimated beyond)",
    ),
    ("outbox_relay_lag_seconds", "Age of the oldest event not yet published"),
    ("outbox_relay_checkpoint_age_seconds", "Seconds since the part's checkpoint last changed"),
    ("outbox_relay_part_claimed", "1 when a live relay owns the part"),
    ("outbox_relay_part_halted", "1 when a poison event halted the part"),
    (
        "outbox_relay_publish_stalled_seconds",
        "Seconds the part has had events to publish without publishing any (0 while it "
        "has none): since its checkpoint last moved, or since its oldest pending event "
        "if that is younger",
    ),
)


def _stalled_for(pending: int, oldest_pending_s: float, checkpoint_age_s: float) -> float:
    """How long a part has had events to publish and published none. A checkpoint that
    has not moved for an hour only counts from when its first pending event arrived."""
    return min(oldest_pending_s, checkpoint_age_s) if pending else 0.0


# The HTTP server: waitress multiplexes connections on one I/O thread and hands
# complete requests to thread pools, so idle or slow clients cost a socket each, never a
# thread; a client silent for CLIENT_TIMEOUT_S is disconnected, and past
# MAX_CONNECTIONS new ones wait in the listen backlog. The probes have a pool of their
# own (PROBE_THREADS), so that no number of slow scrapes can delay them: a liveness
# probe that times out restarts the relay, and every replica's at once.
HTTP_THREADS = 2
PROBE_THREADS = 2  # liveness and readiness at once
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
MAX_CONNECTIONS = 100
CLIENT_TIMEOUT_S = 10
# No endpoint takes a body: one is refused (413) from its headers, before waitress would
# read it, and so spool it to a temporary file. Headers stay small too.
MAX_BODY_BYTES = 0
MAX_HEADER_BYTES = 16 * 1024
ALLOWED_METHODS = ("GET", "HEAD")


class _ProbesApart:
    """The task dispatcher waitress hands each complete request to: requests for
    PROBE_PATHS go to one pool of threads, all others (scrapes) to another.

    waitress queues a connection when its next request is complete, and that request
    is the connection's first pending one, which decides the pool."""

    def __init__(self) -> None:
        self.probes = ThreadedTaskDispatcher()
        self.others = ThreadedTaskDispatcher()
        self.probes.set_thread_count(PROBE_THREADS)

    def set_thread_count(self, count: int) -> None:
        self.others.set_thread_count(count)

    def add_task(self, channel: Any) -> None:
        requests = getattr(channel, "requests", None)
        path = getattr(requests[0], "path", None) if requests else None
        (self.probes if path in PROBE_PATHS else self.others).add_task(channel)

    def shutdown(self, cancel_pending: bool = True, timeout: float = 5) -> bool:
        probes = self.probes.shutdown(cancel_pending, timeout)
        others = self.others.shutdown(cancel_pending, timeout)
        return bool(probes and others)


class HealthServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port, served by waitress."""

    def __init__(
        self, relay: RelayView, open_store: Callable[[], OutboxStore], settings: Settings
    ) -> None:
        host, port = settings.metrics_host, settings.metrics_port
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = RelayCollector(relay, open_store, settings.metrics_cache_ttl)
        self.registry.register(self.collector)
        self._relay = relay
        self._metrics = make_wsgi_app(self.registry)
        dispatcher = _ProbesApart()
        dispatcher.set_thread_count(HTTP_THREADS)
        try:
            self._server = create_server(
                self._app,
                host=host,
                port=port,
                # waitress's hook for a dispatcher of one's own (it calls it a test
                # shim; waitress is pinned below 4, and tests/acceptance/
                # test_observability.py checks that probes keep their threads).
                _dispatcher=dispatcher,
                connection_limit=MAX_CONNECTIONS,
                channel_timeout=CLIENT_TIMEOUT_S,
                cleanup_interval=1,
                max_request_body_size=MAX_BODY_BYTES,
                max_request_header_size=MAX_HEADER_BYTES,
                ident="outbox-relay",
                clear_untrusted_proxy_headers=True,
                # poll(), not select(): select() fails on descriptors above 1023, and a
                # relay of 100 parts holds more than that (a connection and a producer's
                # sockets each), which would stop the endpoints.
                asyncore_use_poll=True,
            )
        except OSError as exc:
            dispatcher.shutdown(timeout=1)
            raise ConfigError(
                f"metrics_port: cannot listen on {host}:{port}: {exc.strerror} "
                "(RELAY_METRICS_PORT=0 picks a free port, RELAY_METRICS_ENABLED=false turns it off)"
            ) from exc
        self.host = host
        self.port = int(self._server.effective_port)
        self._thread = threading.Thread(target=self._server.run, name="relay-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "serving /metrics, /healthz and /readyz on %s:%s",
            self.host,
            self.port,
            extra=log_extra("http_serving", host=self.host, port=self.port),
        )

    def stop(self) -> None:
        # Close every socket from the I/O thread itself (a trigger runs it there), so
        # its poll never sees a descriptor closed underneath it; then its loop ends.
        if not self._run_in_loop(self._close_all):
            # Nothing can wake the loop: close from here. Each socket leaves the loop's
            # map as it closes, so the loop ignores what poll says of it, then ends.
            self._close_all()
        self._thread.join(5.0)
        self._server.task_dispatcher.shutdown(timeout=5)
        self.collector.database.close()

    def _run_in_loop(self, thunk: Callable[[], None]) -> bool:
        """Have the I/O thread run ``thunk``; False when its wake-up pipe is gone.

        waitress's loop closes that pipe itself when poll() reports it hung up or
        invalid, and writing to its old number then fails (or, were the number reused,
        would write into someone else's file), so a closed one is never written to."""
        trigger = self._server.trigger
        try:
            if not trigger._closed:
                trigger.pull_trigger(thunk)
                return True
            error = "closed by the server's loop"
        except OSError as exc:
            error = exc.strerror or str(exc)
        logger.warning(
            "the HTTP server's wake-up pipe is gone (%s): closing its sockets from here",
            error,
            extra=log_extra("http_wakeup_lost", error=error),
        )
        return False

    def _close_all(self) -> None:
        for dispatcher in list(self._server._map.values()):
            dispatcher.close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ALLOWED_METHODS:
            return _text(start_response, False, "only GET and HEAD", 405, allow=ALLOWED_METHODS)
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            body: Iterable[bytes] = self._metrics(environ, start_response)
            return body
        if path == "/healthz":
            return _text(start_response, *self._relay.healthy())
        if path == "/readyz":
            return _text(start_response, *self._relay.ready())
        return _text(start_response, False, "not found: try /metrics, /healthz or /readyz", 404)


def _text(
    start_response: StartResponse,
    ok: bool,
    body: str,
    failure: int = 503,
    *,
    allow: tuple[str, ...] = (),
) -> list[bytes]:
    data = body.encode()
    status = "200 OK" if ok else f"{failure} {HTTPStatus(failure).phrase}"
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    if allow:
        headers.append(("Allow", ", ".join(allow)))
    start_response(status, headers)
    return [data]
