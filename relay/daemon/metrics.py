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
  one heartbeat interval), and no part waits for a privilege or an ACL it lacks. A
  halted part, or one waiting for the schema registry or a topic, leaves it ready
  (``Relay.ready`` says why).
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
from waitress.task import ThreadedTaskDispatcher  # type: ignore[import-untyped]

from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import StatusStore
from relay.core.settings import Settings
from relay.core.worker_stats import COUNTERS as _COUNTERS  # the workers' counters, declared there
from relay.daemon.listener import Listener
from relay.errors import ConfigError, RelayError
from relay.observability import latency
from relay.ops.lag import EXACT_UP_TO, subscriber_statuses

if TYPE_CHECKING:
    from wsgiref.types import StartResponse

logger = logging.getLogger(__name__)


def _latency_histogram(totals: dict[PartId, Counter[str]]) -> Metric:
    """Commit→visible latency per part, from the buckets its workers counted
    (relay/observability/latency.py says where "commit" comes from)."""
    family = HistogramMetricFamily(
        "outbox_relay_commit_to_visible_seconds",
        "Seconds from an event's commit (its occurred_at: the writer's transaction start, "
        "unless the writer set it) to its batch's Kafka commit",
        labels=["subscriber", "part"],
    )
    bounds = [*(str(b) for b in latency.LATENCY_BUCKETS), "+Inf"]
    for part, stats in sorted(totals.items()):
        cumulative, buckets = 0.0, []
        for bound in bounds:
            cumulative += stats.get(f"{latency.LATENCY_KEY}_le_{bound}", 0)
            buckets.append((bound, cumulative))
        family.add_metric(
            [part.subscriber, str(part.part)],
            buckets,
            sum_value=stats.get(latency.SUM_KEY, 0) / 1e6,
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
        self, relay: RelayView, open_store: Callable[[], StatusStore], ttl: float = 0.0
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
            "(service: schema_registry, kafka or postgres), a topic it publishes to does "
            "not exist and create_topics is false (topic), the relay's role lacks a "
            "Postgres privilege (postgres_privilege) or its principal a Kafka ACL "
            "(kafka_acl), or max_created_topics topics were created for rows already and a "
            "row's new topic must wait (topic_budget); it publishes nothing meanwhile, and "
            "halts and dead-letters nothing for it",
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

    def __init__(self, open_store: Callable[[], StatusStore], ttl: float) -> None:
        self._open_store = open_store
        self._ttl = ttl
        self._lock = threading.Lock()
        self._store: StatusStore | None = None  # used by the reading thread only
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


def _database(store: StatusStore) -> Iterator[Metric]:
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
    (
        "outbox_relay_lag_seconds",
        "Seconds since the database recorded the oldest event not yet published (its "
        "recorded_at: the INSERT's time, never the occurred_at a writer may set)",
    ),
    ("outbox_relay_checkpoint_age_seconds", "Seconds since the part's checkpoint last changed"),
    ("outbox_relay_part_claimed", "1 when a live relay owns the part"),
    ("outbox_relay_part_halted", "1 when a poison event halted the part"),
    (
        "outbox_relay_publish_stalled_seconds",
        "Seconds the part has had events to publish without publishing any (0 while it "
        "has none): since its checkpoint last moved, or since the database recorded its "
        "oldest pending event if that is younger",
    ),
)


def _stalled_for(pending: int, oldest_pending_s: float, checkpoint_age_s: float) -> float:
    """How long a part has had events to publish and published none. A checkpoint that
    has not moved for an hour only counts from when its first pending event arrived."""
    return min(oldest_pending_s, checkpoint_age_s) if pending else 0.0


# The HTTP server: waitress multiplexes connections on one I/O thread per port and
# hands complete requests to thread pools, so idle or slow clients cost a socket each,
# never a thread; relay/daemon/listener.py bounds how long and how many of them
# a port holds. The probes have a port of their own (probe_port), which serves nothing
# else, so that no number of scrapes and slow clients can use up what the kubelet
# reaches: a liveness probe that times out restarts the relay, and every replica's at
# once. The metrics port answers them too (older manifests probe it), from a pool of
# their own (PROBE_THREADS), so that slow scrapes never delay them there either.
HTTP_THREADS = 2
PROBE_THREADS = 2  # liveness and readiness at once
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
ALLOWED_METHODS = ("GET", "HEAD")


class _ProbesApart:
    """The task dispatcher waitress hands each complete request to: requests for
    PROBE_PATHS go to one pool of threads, all others (scrapes) to another.

    waitress queues a connection when its next request is complete, and that request
    is the connection's first pending one, which decides the pool."""

    def __init__(self) -> None:
        self.probes = _pool(PROBE_THREADS)
        self.others = _pool(HTTP_THREADS)

    def add_task(self, channel: Any) -> None:
        requests = getattr(channel, "requests", None)
        path = getattr(requests[0], "path", None) if requests else None
        (self.probes if path in PROBE_PATHS else self.others).add_task(channel)

    def shutdown(self, cancel_pending: bool = True, timeout: float = 5) -> bool:
        probes = self.probes.shutdown(cancel_pending, timeout)
        others = self.others.shutdown(cancel_pending, timeout)
        return bool(probes and others)


def _pool(threads: int) -> ThreadedTaskDispatcher:
    pool = ThreadedTaskDispatcher()
    pool.set_thread_count(threads)
    return pool


class HealthServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on the metrics port; ``/healthz`` and
    ``/readyz`` alone on the probe port."""

    def __init__(
        self, relay: RelayView, open_store: Callable[[], StatusStore], settings: Settings
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = RelayCollector(relay, open_store, settings.metrics_cache_ttl)
        self.registry.register(self.collector)
        self._relay = relay
        self._metrics = make_wsgi_app(self.registry)
        self.host = settings.metrics_host
        self.listener = _listen(
            "metrics", self._app, self.host, settings.metrics_port, _ProbesApart()
        )
        try:
            self.probe_listener = _listen(
                "probes",
                self._probe_app,
                self.host,
                settings.probe_listen_port,
                _pool(PROBE_THREADS),
            )
        except ConfigError:
            self.listener.stop()
            raise
        self.port = self.listener.port
        self.probe_port = self.probe_listener.port
        self.registry.register(_DroppedConnections(self))

    def start(self) -> None:
        self.listener.start()
        self.probe_listener.start()
        logger.info(
            "serving /metrics, /healthz and /readyz on %s:%s, and /healthz and /readyz on %s:%s",
            self.host,
            self.port,
            self.host,
            self.probe_port,
            extra=log_extra(
                "http_serving", host=self.host, port=self.port, probe_port=self.probe_port
            ),
        )

    def stop(self) -> None:
        self.probe_listener.stop()
        self.listener.stop()
        self.collector.database.close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == "/metrics" and _allowed(environ):
            body: Iterable[bytes] = self._metrics(environ, start_response)
            return body
        return self._probe_app(environ, start_response)

    def _probe_app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not _allowed(environ):
            return _text(start_response, False, "only GET and HEAD", 405, allow=ALLOWED_METHODS)
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start_response, *self._relay.healthy())
        if path == "/readyz":
            return _text(start_response, *self._relay.ready())
        return _text(start_response, False, f"not found: try {self._paths(environ)}", 404)

    def _paths(self, environ: dict[str, Any]) -> str:
        on_probes = environ.get("SERVER_PORT") == str(self.probe_port)
        return "/healthz or /readyz" if on_probes else "/metrics, /healthz or /readyz"


def _allowed(environ: dict[str, Any]) -> bool:
    return environ.get("REQUEST_METHOD") in ALLOWED_METHODS


def _listen(name: str, app: Any, host: str, port: int, dispatcher: Any) -> Listener:
    key = "probe_port" if name == "probes" else "metrics_port"
    try:
        return Listener(name, app, host, port, dispatcher)
    except OSError as exc:
        dispatcher.shutdown(timeout=1)
        raise ConfigError(
            f"{key}: cannot listen on {host}:{port}: {exc.strerror} "
            f"(RELAY_{key.upper()}=0 picks a free port, RELAY_METRICS_ENABLED=false turns "
            "the HTTP endpoints off)"
        ) from exc


class _DroppedConnections(Collector):
    """What the listeners closed to keep room for new clients, by port and reason."""

    def __init__(self, server: HealthServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "outbox_relay_http_connections_dropped",
            "Connections the HTTP server closed before they sent a complete request: past "
            "the deadline on a request's headers (header_deadline), or to make room for a "
            "new one (peer_limit: too many from one address; connection_limit: too many)",
            labels=["listener", "reason"],
        )
        for name, listener in (
            ("metrics", self._server.listener),
            ("probes", self._server.probe_listener),
        ):
            for reason in ("header_deadline", "peer_limit", "connection_limit"):
                family.add_metric([name, reason], listener.dropped[reason])
        yield family


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
