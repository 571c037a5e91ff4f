"""The relay daemon: one worker per subscriber, woken by NOTIFY, supervised."""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from relay import db, migrations
from relay.encoding import RecordEncoder
from relay.errors import NotMigratedError
from relay.kafka import KafkaPublisher, Publisher
from relay.notify import NotifyListener
from relay.schemas import SchemaRegistry
from relay.settings import Settings
from relay.store import OutboxStore
from relay.subscribers import DEFAULT_SUBSCRIBER, StartFrom, Subscriber
from relay.worker import SubscriberWorker, WorkerState

logger = logging.getLogger(__name__)

_REFRESH_S = 5.0  # how often to look for subscribers added or removed at run time


class Relay:
    """Publishes every committed outbox event for every subscriber until stopped."""

    def __init__(self, settings: Settings, *, registry: SchemaRegistry | None = None) -> None:
        self.settings = settings
        self.database_url = settings.require_database_url()
        self.bootstrap_servers = settings.require_bootstrap_servers()
        self.registry = registry if registry is not None else _load_registry(settings)
        self.encoder = RecordEncoder(self.registry)
        self.workers: dict[str, SubscriberWorker] = {}
        self._stopping = threading.Event()
        self._listener: NotifyListener | None = None
        self._supervisor: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        with self._connect() as conn:
            store = OutboxStore(conn, self.settings.database_schema)
            self._check_schema(conn)
            self._sync_subscribers(store)
            self._start_workers(store)
        self._listener = NotifyListener(self._connect, self.settings.database_schema, self.wake_all)
        self._listener.start()
        self._supervisor = threading.Thread(
            target=self._supervise, name="relay-supervisor", daemon=True
        )
        self._supervisor.start()
        logger.info(
            "relay started with subscribers %s",
            sorted(self.workers),
            extra={"subscribers": sorted(self.workers)},
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the batch in flight (or abandon it unacknowledged) and stop."""
        self._stopping.set()
        for worker in self.workers.values():
            worker.stop()
        if self._listener is not None:
            self._listener.stop()
        for worker in self.workers.values():
            worker.join(timeout)
        if self._listener is not None:
            self._listener.join(2.0)
        logger.info("relay stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop`; True if stopped."""
        return self._stopping.wait(timeout)

    def wake_all(self) -> None:
        for worker in list(self.workers.values()):
            worker.wakeup.set()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def states(self) -> dict[str, WorkerState]:
        return {name: w.stats.state for name, w in self.workers.items()}

    # -- internals -------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        return db.connect(self.database_url, application_name="outbox-relay")

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        pending = migrations.pending(conn, self.settings.database_schema)
        if pending:
            raise NotMigratedError(
                f"schema {self.settings.database_schema!r} lacks migrations "
                f"{[f'{m.version:04d}_{m.name}' for m in pending]}; run `outbox-relay migrate`"
            )

    def _sync_subscribers(self, store: OutboxStore) -> None:
        """Upsert the subscribers the config declares; with none anywhere, add the default."""
        for declared in self.settings.subscribers:
            created = store.add(declared.to_subscriber(), declared.start_from, replace=True)
            logger.info(
                "%s subscriber %s from config", "created" if created else "updated", declared.name
            )
        if not store.list():
            store.add(Subscriber(DEFAULT_SUBSCRIBER), StartFrom.BEGINNING)
            logger.info(
                "no subscriber configured: created %r routing every event", DEFAULT_SUBSCRIBER
            )

    def _start_workers(self, store: OutboxStore) -> None:
        for name, worker in list(self.workers.items()):
            if worker.stats.state is WorkerState.STOPPED:  # its subscriber was removed
                del self.workers[name]
        for state in store.list():
            name = state.subscriber.name
            # A halted worker stays halted (its error needs a human) until restart.
            if name not in self.workers and not self._stopping.is_set():
                worker = self._new_worker(name)
                self.workers[name] = worker
                worker.start()

    def _new_worker(self, name: str) -> SubscriberWorker:
        return SubscriberWorker(
            name,
            open_store=lambda: OutboxStore(self._connect(), self.settings.database_schema),
            open_publisher=self._new_publisher,
            encoder=self.encoder,
            batch_size=self.settings.batch_size,
            poll_interval=self.settings.poll_interval,
        )

    def _new_publisher(self) -> Publisher:
        s = self.settings
        return KafkaPublisher(
            self.bootstrap_servers,
            config=s.kafka,
            delivery_timeout_s=s.delivery_timeout,
            create_topics=s.create_topics,
            topic_partitions=s.topic_partitions,
            topic_replication_factor=s.topic_replication_factor,
        )

    def _supervise(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stopping.wait(_REFRESH_S):
            try:
                conn = conn if conn is not None and not conn.closed else self._connect()
                self._start_workers(OutboxStore(conn, self.settings.database_schema))
            except Exception as exc:  # the workers report their own errors; keep supervising
                logger.debug("subscriber refresh failed: %s", exc)
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()


def _load_registry(settings: Settings) -> SchemaRegistry | None:
    if settings.schemas_dir.is_dir():
        return SchemaRegistry.from_dir(settings.schemas_dir)
    logger.warning(
        "schemas folder %s not found: only JSON-format subscribers can publish",
        settings.schemas_dir,
    )
    return None
