"""The relay daemon: claims subscriber parts and runs one worker per claimed part.

Several relay processes may run against one database. Each holds a session
(:mod:`relay.sessions`); a supervisor thread spreads the parts over the live
sessions, claims its share, releases what a peer should own, and starts or stops
workers to match. The commit probe wakes the workers; they also poll on a timer.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
from collections import Counter
from typing import Any

import psycopg

from relay import db, migrations
from relay.broker_watch import BrokerWatch
from relay.encoding import RecordEncoder
from relay.errors import ConfigError, NotMigratedError, RelayError, RetryableError
from relay.kafka import (
    IdempotentPublisher,
    TopicCreator,
    TransactionalPublisher,
    producer_config,
)
from relay.key_space import KeySpaceAction, report
from relay.metrics import HealthServer
from relay.model import PartId
from relay.ports import PartState, Publisher
from relay.probe import CommitProbe
from relay.schemas import SchemaRegistry
from relay.sessions import SessionKeeper, assign
from relay.settings import Settings
from relay.store import OutboxStore
from relay.subscribers import DEFAULT_SUBSCRIBER, StartFrom, Subscriber, TopicGuard, ValueFormat
from relay.worker import PartWorker, WorkerState

logger = logging.getLogger(__name__)

# How long the broker watch's request may take before Kafka counts as unreachable.
_BROKER_TIMEOUT_S = 5.0

_HORIZON_CHECK_EVERY_S = 30.0


class Relay:
    """Publishes every committed outbox event for every subscriber until stopped."""

    def __init__(self, settings: Settings, *, registry: SchemaRegistry | None = None) -> None:
        self.settings = settings
        self.database_url = settings.require_database_url()
        self.bootstrap_servers = settings.require_bootstrap_servers()
        self.registry = registry if registry is not None else _load_registry(settings)
        allow = None if settings.topic_allow is None else re.compile(settings.topic_allow)
        self.topic_guard = TopicGuard(settings.checkpoint_topic, allow)
        self.encoder = RecordEncoder(self.registry, self.topic_guard)
        self.workers: dict[PartId, PartWorker] = {}
        self._stopping = threading.Event()
        self._stop_requested = threading.Event()
        self._probe: CommitProbe | None = None
        self._supervisor: threading.Thread | None = None
        self._keeper: SessionKeeper | None = None
        self._broker: BrokerWatch | None = None
        self._http: HealthServer | None = None
        # Statistics of workers that have stopped, so counters never go down.
        self._retired: dict[PartId, Counter[str]] = {}
        self._key_space_changes: Counter[str] = Counter(rebased=0, continued=0)
        self._warned_horizon_blind = False
        # Workers this relay told to stop; any other that ends did so on its own.
        self._told_to_stop: set[PartWorker] = set()
        self._topics = TopicCreator(
            {**settings.kafka, "bootstrap.servers": self.bootstrap_servers},
            enabled=settings.create_topics,
            partitions=settings.topic_partitions,
            replication_factor=settings.topic_replication_factor,
            max_created=None if settings.max_created_topics < 0 else settings.max_created_topics,
            relay_owned=self.topic_guard.relay_owned,
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Check the schema, open a session and claim a share of the parts. On failure
        (Postgres or Kafka unreachable, say) nothing is left running: call it again."""
        try:
            self._start()
        except BaseException:
            self._abandon_start()
            raise

    def _start(self) -> None:
        if self.settings.metrics_enabled and self._http is None:
            s = self.settings
            self._http = HealthServer(
                self, self._open_store, s.metrics_host, s.metrics_port, s.metrics_cache_ttl
            )
            self._http.start()
        with self._connect() as conn:
            store = OutboxStore(conn, self.settings.database_schema)
            self._check_schema(conn)
            self._check_key_space(store, "start-up")
            self._sync_subscribers(store)
        self._broker = BrokerWatch(
            {**self.settings.kafka, "bootstrap.servers": self.bootstrap_servers},
            interval=max(1.0, min(self.settings.heartbeat_interval, 5.0)),
            timeout=_BROKER_TIMEOUT_S,
        )
        self._broker.start()
        if self._broker.wait_first(_BROKER_TIMEOUT_S + 2.0):
            self._open_session()
        # Otherwise no session yet: peers keep every part; the supervisor opens one once
        # Kafka answers.
        self._probe = CommitProbe(
            self._connect,
            self.settings.database_schema,
            self.wake_all,
            interval=self.settings.probe_interval,
            idle_interval=self.settings.probe_idle_interval,
        )
        self._probe.start()
        self._rebalance_safely()
        self._supervisor = threading.Thread(
            target=self._supervise, name="relay-supervisor", daemon=True
        )
        self._supervisor.start()
        logger.info(
            "relay started (session %s) with parts %s",
            self.session_id,
            sorted(str(p) for p in self.workers),
            extra={"session": str(self.session_id)},
        )

    def _open_session(self) -> None:
        self._keeper = SessionKeeper(
            self._open_store,
            timeout=self.settings.session_timeout,
            heartbeat_interval=self.settings.heartbeat_interval,
            on_lost=self._abandon_workers,
        )
        self._keeper.start()

    def _mind_broker(self) -> None:
        """Hold a session (and so parts) only while Kafka answers."""
        broker = self._broker
        if broker is None or self._stopping.is_set():
            return
        if self._keeper is None:
            if broker.reachable:
                logger.info("Kafka answers: this relay takes its share of the parts")
                self._open_session()
            return
        down = broker.unreachable_for()
        if down >= self.settings.session_timeout:
            logger.error(
                "%s (%.0fs): giving this relay's parts to its peers",
                broker.describe(),
                down,
                extra={"unreachable_s": down},
            )
            keeper, self._keeper = self._keeper, None
            keeper.session.lost.set()  # workers stop before publishing anything more
            self._stop_all_workers(time.monotonic() + 5.0)
            keeper.close(timeout=5.0)  # deletes the session: every claim is free at once

    def stop(self, timeout: float | None = None) -> None:
        """Finish (or abandon, unacknowledged) each batch in flight, release every
        claim, and return within ``timeout`` seconds (``shutdown_timeout`` by default)."""
        deadline = time.monotonic() + (
            self.settings.shutdown_timeout if timeout is None else timeout
        )
        self._stopping.set()
        self._stop_requested.set()
        if self._supervisor is not None:
            self._supervisor.join(max(0.0, deadline - time.monotonic()))
        self._stop_all_workers(deadline)
        if self._probe is not None:
            self._probe.stop()
        if self._broker is not None:
            self._broker.stop()
        if self._keeper is not None:  # deletes the session: peers may claim at once
            self._keeper.close(timeout=max(1.0, deadline - time.monotonic()))
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self._probe is not None:
            self._probe.join(max(0.0, min(2.0, deadline - time.monotonic())))
        logger.info("relay stopped")

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (safe in a signal handler: it only sets a flag)."""
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`request_stop` or :meth:`stop`; True if asked to stop."""
        return self._stop_requested.wait(timeout)

    def wake_all(self) -> None:
        for worker in list(self.workers.values()):
            worker.wakeup.set()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def session_id(self) -> str | None:
        return None if self._keeper is None else str(self._keeper.session.id)

    @property
    def states(self) -> dict[str, WorkerState]:
        return {str(part): w.stats.state for part, w in self.workers.items()}

    def worker(self, subscriber: str, part: int = 0) -> PartWorker:
        return self.workers[PartId(subscriber, part)]

    # -- observability ---------------------------------------------------------------

    def part_totals(self) -> dict[PartId, Counter[str]]:
        """Cumulative statistics per part, over every worker this process has run."""
        totals = {part: Counter(c) for part, c in self._retired.items()}
        for part, worker in list(self.workers.items()):
            totals.setdefault(part, Counter()).update(_counts(worker))
        return totals

    def key_space_changes(self) -> Counter[str]:
        """Moves of the database found by this process, by what was done about them."""
        found = Counter(self._key_space_changes)
        for totals in self.part_totals().values():
            found["rebased"] += totals["key_space_rebased"]
            found["continued"] += totals["key_space_continued"]
        return found

    def part_states(self) -> dict[PartId, str]:
        return {part: w.stats.state.value for part, w in list(self.workers.items())}

    def healthy(self) -> tuple[bool, str]:
        """Liveness: the threads that keep the relay going are alive."""
        for name, thread in (("supervisor", self._supervisor), ("session", self._keeper)):
            if thread is not None and not thread.is_alive() and not self._stopping.is_set():
                return False, f"the {name} thread died"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Readiness: a live session, so this relay can own and publish parts.

        A halted part leaves the relay ready: the halt is in Postgres, so every replica
        (and a new one rolled out with the fix) would be unready too, blocking the
        rollout that could fix it. Halts are alerted on from /metrics instead
        (deploy/README.md); the reply names them for whoever looks.
        """
        if self._stopping.is_set():
            return False, "stopping"
        if self._keeper is None:
            if self._broker is not None and self._broker.reachable is False:
                return False, f"no parts: {self._broker.describe()}"
            return False, "starting (waiting for Postgres or Kafka?)"
        if not self._keeper.session.valid():
            return False, "no live session (Postgres unreachable?)"
        halted = sorted(str(p) for p, s in self.part_states().items() if s == WorkerState.HALTED)
        return True, (
            f"ready: session {self._keeper.session.id}, {len(self.workers)} parts"
            + (f"; halted: {', '.join(halted)}" if halted else "")
        )

    def _retire(self, part: PartId, worker: PartWorker, store: OutboxStore, halted: bool) -> None:
        # Ended on its own in state HALTED: a fatal error, unless the part was already
        # halted in Postgres (a poison event), whose worker then lost its claim.
        failed = (
            worker not in self._told_to_stop
            and worker.stats.state is WorkerState.HALTED
            and not halted
        )
        self._told_to_stop.discard(worker)
        self._retired.setdefault(part, Counter()).update(_counts(worker), failures=int(failed))
        del self.workers[part]
        if failed:
            self._record_failure(store, part, worker)

    def _record_failure(self, store: OutboxStore, part: PartId, worker: PartWorker) -> None:
        """A worker stopped on an error that retrying cannot fix (a missing privilege, a
        refused Kafka setting). Halt the part in Postgres, as a poison event does: the
        next worker waits for `subscribers resume` instead of failing in a silent loop,
        and `status`, /metrics and every relay show why."""
        error = f"part worker stopped: {worker.stats.last_error}"
        if self._keeper is None:  # gave its session up meanwhile: the claim is gone too
            logger.warning("part %s stopped: %s (not recorded: no session)", part, error)
            return
        try:
            store.halt(store.get_part(*part), self._keeper.session.id, error)
        except RelayError as exc:
            logger.warning("part %s stopped, and its halt cannot be recorded: %s", part, exc)
            return
        logger.error(
            "part %s halted (`outbox-relay subscribers resume %s` retries it): %s",
            part,
            part.subscriber,
            error,
            extra={"part": str(part), "error": error},
        )

    def _stop_worker(self, worker: PartWorker) -> None:
        self._told_to_stop.add(worker)
        worker.stop()

    # -- claims and workers --------------------------------------------------------------

    def _supervise(self) -> None:
        store: OutboxStore | None = None
        last_horizon_check = 0.0
        last_prune = time.monotonic()  # not right at start-up: let the relays settle
        while not self._stopping.wait(self.settings.heartbeat_interval):
            try:
                self._mind_broker()
                store = store if store is not None and not store.closed else self._open_store()
                self._rebalance(store)
                if time.monotonic() - last_horizon_check > _HORIZON_CHECK_EVERY_S:
                    last_horizon_check = time.monotonic()
                    self._report_stalled_horizon(store)
                every = self.settings.prune_every
                if every and time.monotonic() - last_prune > every:
                    last_prune = time.monotonic()
                    self._prune(store)
            except RelayError as exc:  # the workers report their own errors; keep going
                logger.warning("rebalance failed: %s", exc)
                if store is not None:
                    store.close()
                store = None
        if store is not None:
            store.close()

    def _prune(self, store: OutboxStore) -> None:
        """Retention, by one relay only: the one with the oldest live session id."""
        if self._keeper is None:
            return
        sessions = store.live_sessions()
        if not sessions or sessions[0] != self._keeper.session.id:
            return
        # A moved database's checkpoints are of the old key space until rebased.
        self._check_key_space(store, "retention")
        deleted = sum(store.prune(self.settings.retention))
        if deleted:
            logger.info("pruned %s published rows", deleted, extra={"pruned": deleted})

    def _report_stalled_horizon(self, store: OutboxStore) -> None:
        """Name the transactions that keep newer events from being published."""
        if not self._warned_horizon_blind and not store.sees_all_sessions():
            self._warned_horizon_blind = True
            logger.warning(
                "this relay's role cannot see other roles' transactions in pg_stat_activity "
                "(it lacks pg_read_all_stats): how long another role's transaction has held "
                "publication back is unknown, so it is not logged, and /metrics leaves out "
                "outbox_relay_horizon_held_seconds. `outbox-relay grant --relay-role ROLE "
                "--read-all-stats` allows it (the role then sees every session's query text)"
            )
        for holder in store.horizon_holders():
            if holder.age_s is None:
                continue  # another role's session, hidden from this one (warned above)
            if holder.age_s < self.settings.horizon_warn_after:
                break  # oldest first
            logger.warning(
                "publication held back %.0fs by pid %s (xid %s, %s, application %r, "
                "query started %s): events committed after it wait until it ends",
                holder.age_s,
                holder.pid,
                holder.xid,
                holder.state,
                holder.application_name,
                holder.query_start,
                extra={
                    "horizon_pid": holder.pid,
                    "horizon_xid": holder.xid,
                    "horizon_age_s": holder.age_s,
                    "horizon_state": holder.state,
                    "horizon_application": holder.application_name,
                },
            )

    def _rebalance_safely(self) -> None:
        try:
            store = self._open_store()
            try:
                self._rebalance(store)
            finally:
                store.close()
        except RetryableError as exc:
            logger.warning("first rebalance failed, the supervisor retries: %s", exc)

    def _abandon_start(self) -> None:
        self._abandon_workers()
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._probe is not None:
            self._probe.stop()
            self._probe = None
        if self._keeper is not None:
            self._keeper.close(timeout=5.0)
            self._keeper = None

    def _rebalance(self, store: OutboxStore) -> None:
        """Match claims and workers to this relay's share of the parts."""
        subscribers = store.list()
        self.topic_guard.update(s.subscriber for s in subscribers)
        parts = {PartId(p.name, p.part): p for s in subscribers for p in s.parts}
        for part, worker in list(self.workers.items()):
            if not worker.is_alive():
                halted = part in parts and parts[part].halted_error is not None
                self._retire(part, worker, store, halted)  # lost claim, removed subscriber...
        if self._keeper is None:  # no session (Kafka unreachable): no share
            return
        me = self._keeper.session.id
        owners = {part: p.owner for part, p in parts.items()}
        mine = {
            p for p, session in assign(list(owners), store.live_sessions()).items() if session == me
        }
        for part, worker in list(self.workers.items()):
            if part not in mine or owners.get(part) != me:
                self._stop_worker(worker)  # a peer should own it: release after the batch
        for part in list(owners):
            running = self.workers.get(part)
            if (
                part not in mine
                and owners[part] == me
                and (running is None or not running.is_alive())
            ):
                store.release(part.subscriber, part.part, me)
                logger.info("released part %s to a peer", part, extra={"part": str(part)})
        if self._stopping.is_set() or not self._keeper.session.valid():
            return
        for part in sorted(mine):
            if part in self.workers:
                continue
            if owners[part] is None and store.claim(part.subscriber, part.part, me):
                logger.info("claimed part %s", part, extra={"part": str(part)})
            elif owners[part] != me:
                continue  # still owned by a peer, which releases it on its next round
            self._start_worker(part)

    def _start_worker(self, part: PartId) -> None:
        assert self._keeper is not None
        worker = PartWorker(
            part,
            session=self._keeper.session,
            open_store=self._open_store,
            open_publisher=self._new_publisher,
            encoder=self.encoder,
            batch_size=self.settings.batch_size,
            batch_max_bytes=self.settings.batch_max_bytes,
            poll_interval=self.settings.poll_interval,
        )
        self.workers[part] = worker
        worker.start()

    def _abandon_workers(self) -> None:
        """The session is gone: every worker stops at once (without waiting for them,
        so the keeper can open a new session and heartbeat it)."""
        for worker in list(self.workers.values()):
            self._stop_worker(worker)

    def _stop_all_workers(self, deadline: float | None = None) -> None:
        workers = list(self.workers.values())
        for worker in workers:
            self._stop_worker(worker)
        end = (
            deadline if deadline is not None else time.monotonic() + self.settings.shutdown_timeout
        )
        for worker in workers:
            worker.join(max(0.0, end - time.monotonic()))
            if worker.is_alive():
                logger.warning("part %s did not finish its batch in time", worker.part)

    def _new_publisher(self, state: PartState) -> Publisher:
        s = self.settings
        config = producer_config(self.bootstrap_servers, s.kafka, int(s.delivery_timeout * 1000))
        if s.delivery == "idempotent":
            return IdempotentPublisher(config, self._topics, s.delivery_timeout)
        name = f"{s.kafka_id_prefix}.{state.name}.{state.part}"
        return TransactionalPublisher(
            config,
            self._topics,
            s.delivery_timeout,
            transactional_id=f"{name}.{state.subscriber_id}",
            group_prefix=name,
            checkpoint_topic=s.checkpoint_topic,
            consumer_config={**s.kafka, "bootstrap.servers": self.bootstrap_servers},
        )

    # -- internals -------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        return db.connect(self.database_url, application_name="outbox-relay")

    def _open_store(self) -> OutboxStore:
        return OutboxStore(self._connect(), self.settings.database_schema)

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        pending = migrations.pending(conn, self.settings.database_schema)
        names = [f"{m.version:04d}_{m.name}" for m in pending]
        if any(m.version <= migrations.RELAY_NEEDS for m in pending):
            raise NotMigratedError(
                f"schema {self.settings.database_schema!r} lacks migrations {names}; "
                "run `outbox-relay migrate`"
            )
        if pending:
            # A rolling deploy: the relay runs on the older schema; the migration brings
            # per-key database order and an untaxed write path.
            logger.warning(
                "schema %r lacks migrations %s; the relay runs on it, but apply them "
                "(`outbox-relay migrate`)",
                self.settings.database_schema,
                names,
            )

    def _check_key_space(self, store: OutboxStore, where: str) -> None:
        check = store.check_key_space()
        if check is not None and check.action is not KeySpaceAction.UNCHANGED:
            report(check, where)
            self._key_space_changes[check.action.value] += 1

    @property
    def default_format(self) -> ValueFormat:
        """Subscribers that name no format: Avro only when there are writer schemas."""
        return ValueFormat.AVRO if self.registry is not None else ValueFormat.JSON

    def _sync_subscribers(self, store: OutboxStore) -> None:
        """Upsert the subscribers the config declares; with none anywhere, add the default."""
        for declared in self.settings.subscribers:
            subscriber = declared.to_subscriber(self.default_format)
            created = store.add(subscriber, declared.start_from, replace=True)
            logger.info(
                "%s subscriber %s from config", "created" if created else "updated", declared.name
            )
        if not store.list():
            default = Subscriber(DEFAULT_SUBSCRIBER, value_format=self.default_format)
            store.add(default, StartFrom.BEGINNING)
            logger.info(
                "no subscriber configured: created %r routing every event as %s",
                DEFAULT_SUBSCRIBER,
                default.value_format,
            )
        self._refuse_avro_without_schemas(store)

    def _refuse_avro_without_schemas(self, store: OutboxStore) -> None:
        if self.registry is not None:
            return
        avro = [
            s.subscriber.name
            for s in store.list()
            if s.subscriber.value_format is ValueFormat.AVRO and not s.subscriber.paused
        ]
        if avro:
            raise ConfigError(
                f"subscribers {avro} publish Avro, but no schemas folder is configured "
                "(schemas_dir, RELAY_SCHEMAS_DIR or --schemas-dir); configure it, or switch "
                "them to JSON: outbox-relay subscribers add NAME --format json --replace"
            )


def _counts(worker: PartWorker) -> Counter[str]:
    stats = worker.stats
    with stats.lock:
        return Counter(
            published=stats.published,
            published_bytes=stats.published_bytes,
            batches=stats.batches,
            errors=stats.errors,
            dead_lettered=stats.dead_lettered,
            poisoned=stats.poisoned,
            unexpected=stats.unexpected,
            recovered=stats.recovered,
            recoveries_refused=stats.recoveries_refused,
            key_space_rebased=stats.key_space_rebased,
            key_space_continued=stats.key_space_continued,
        )  # "failures" is counted when a worker is retired


def _load_registry(settings: Settings) -> SchemaRegistry | None:
    """The configured writer schemas; a configured folder that is missing is an error
    now, not a halt at the first event."""
    folder = settings.schemas_dir
    if folder is None:
        return None
    if not folder.is_dir():
        raise ConfigError(
            f"schemas_dir: {str(folder)!r} is not a folder (from the config file, "
            "RELAY_SCHEMAS_DIR or --schemas-dir); point it at your .avsc files, or unset it "
            "to publish JSON"
        )
    return SchemaRegistry.from_dir(folder)


def tune_gc() -> None:
    """Make the cyclic garbage collector run less often (process-wide: the CLI's call).

    Publishing allocates tens of thousands of short-lived, acyclic objects per batch,
    which reference counting frees; at the default thresholds the collector still walks
    the young generations every 700 allocations, about a fifth of the relay's CPU time.
    Objects from start-up (modules, settings) are frozen out of the walks altogether.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
