"""Prometheus ``/metrics``, and ``/healthz`` / ``/readyz`` for orchestrators.

Everything is collected at scrape time: counters from the workers' statistics (plus the
totals of workers that have stopped, so counters never go down), and lag, checkpoint
age, horizon and claims from Postgres. The hot path is not instrumented.

* ``/healthz`` (liveness): the relay's threads are alive. A relay that only waits for
  Postgres or Kafka is healthy: restarting it would not help.
* ``/readyz`` (readiness): the relay holds a live session and its last look at Postgres
  succeeded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relay.errors import ConfigError, RelayError
from relay.store import OutboxStore

if TYPE_CHECKING:
    from relay.daemon import Relay

logger = logging.getLogger(__name__)

_COUNTERS = {
    "published": ("outbox_relay_published_events", "Events published to Kafka"),
    "published_bytes": ("outbox_relay_published_bytes", "Key and value bytes published"),
    "batches": ("outbox_relay_batches", "Batches committed (Kafka, then checkpoint)"),
    "errors": ("outbox_relay_errors", "Errors (retried or halting)"),
    "dead_lettered": ("outbox_relay_dead_lettered_events", "Poison events dead-lettered"),
    "recovered": ("outbox_relay_recoveries", "Kafka-side checkpoints adopted on takeover"),
    "recoveries_refused": (
        "outbox_relay_recoveries_refused",
        "Kafka-side checkpoints ahead of Postgres not shown to belong to this database",
    ),
}


class RelayCollector(Collector):
    """Reads the relay's state when Prometheus scrapes."""

    def __init__(self, relay: Relay, open_store: Callable[[], OutboxStore]) -> None:
        self._relay = relay
        self._open_store = open_store
        self._store: OutboxStore | None = None
        self._lock = threading.Lock()
        self.last_database_ok: float | None = None

    def collect(self) -> Iterator[Metric]:
        yield from self._counters()
        with self._lock:
            try:
                yield from self._database()
                self.last_database_ok = time.monotonic()
            except RelayError as exc:
                logger.warning("metrics: cannot read Postgres: %s", exc)
                if self._store is not None:
                    self._store.conn.close()
                self._store = None

    def _counters(self) -> Iterator[Metric]:
        totals = self._relay.part_totals()
        for field, (name, doc) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["subscriber", "part"])
            for part, stats in sorted(totals.items()):
                family.add_metric([part.subscriber, str(part.part)], stats.get(field, 0))
            yield family
        state = GaugeMetricFamily(
            "outbox_relay_part_state",
            "1 for the state each part this relay runs is in",
            labels=["subscriber", "part", "state"],
        )
        for part, worker_state in sorted(self._relay.part_states().items()):
            state.add_metric([part.subscriber, str(part.part), worker_state], 1)
        yield state
        moves = CounterMetricFamily(
            "outbox_relay_key_space_changes",
            "Database moves this relay found: 'rebased' (keys rewritten below the new "
            "cluster's transaction ids) or 'continued' (new cluster, same id space)",
            labels=["action"],
        )
        for action, count in sorted(self._relay.key_space_changes().items()):
            moves.add_metric([action], count)
        yield moves

    def _database(self) -> Iterator[Metric]:
        if self._store is None or self._store.conn.closed:
            self._store = self._open_store()
        store = self._store
        lag = GaugeMetricFamily(
            "outbox_relay_lag_events", "Events not yet published", labels=["subscriber", "part"]
        )
        lag_s = GaugeMetricFamily(
            "outbox_relay_lag_seconds",
            "Age of the oldest event not yet published",
            labels=["subscriber", "part"],
        )
        age = GaugeMetricFamily(
            "outbox_relay_checkpoint_age_seconds",
            "Seconds since the part's checkpoint last changed",
            labels=["subscriber", "part"],
        )
        claimed = GaugeMetricFamily(
            "outbox_relay_part_claimed",
            "1 when a live relay owns the part",
            labels=["subscriber", "part"],
        )
        halted = GaugeMetricFamily(
            "outbox_relay_part_halted",
            "1 when a poison event halted the part",
            labels=["subscriber", "part"],
        )
        now = time.time()
        for subscriber in store.list():
            for p in subscriber.parts:
                labels = [p.name, str(p.part)]
                lag.add_metric(labels, store.pending(p))
                lag_s.add_metric(labels, store.oldest_pending_age(p))
                age.add_metric(labels, max(0.0, now - p.updated_at.timestamp()))
                claimed.add_metric(labels, 1 if p.owner is not None else 0)
                halted.add_metric(labels, 1 if p.halted_error else 0)
        yield from (lag, lag_s, age, claimed, halted)
        holders = store.horizon_holders()
        yield GaugeMetricFamily(
            "outbox_relay_horizon_held_seconds",
            "Age of the oldest open transaction holding back publication",
            value=holders[0].age_s if holders else 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_relay_live_sessions",
            "Relay sessions alive in this database",
            value=len(store.live_sessions()),
        )


class HealthServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port, in a daemon thread."""

    def __init__(self, relay: Relay, open_store: Callable[[], OutboxStore], host: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = RelayCollector(relay, open_store)
        self.registry.register(self.collector)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("http: %s", format % args)

        self._relay = relay
        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(
                f"metrics_port: cannot listen on {host}:{port}: {exc.strerror} "
                "(RELAY_METRICS_PORT=0 picks a free port, RELAY_METRICS_ENABLED=false turns it off)"
            ) from exc
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="relay-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        logger.info("serving /metrics, /healthz and /readyz on port %s", self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(request, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            ok, why = self._relay.healthy()
            self._reply(request, 200 if ok else 503, why.encode())
        elif path == "/readyz":
            ok, why = self._relay.ready()
            self._reply(request, 200 if ok else 503, why.encode())
        else:
            self._reply(request, 404, b"not found: try /metrics, /healthz or /readyz")

    @staticmethod
    def _reply(
        request: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
