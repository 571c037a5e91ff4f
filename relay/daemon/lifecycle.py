"""The relay's lifecycle: start, stop, the supervisor thread, and health for /healthz and
/readyz. The concerns it supervises live in the sibling modules; :class:`Relay` composes
them."""

from __future__ import annotations

import ctypes
import gc
import logging
import re
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from relay import wiring
from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import DaemonStore, PartStore, StatusStore
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import TopicGuard
from relay.core.worker_stats import WorkerState
from relay.daemon.context import DaemonContext
from relay.daemon.membership import Membership
from relay.daemon.metrics import HealthServer
from relay.daemon.parts import ClaimedParts
from relay.daemon.startup import KeySpaceChecks, adopt_topics, check_schema
from relay.daemon.upkeep import HorizonWatch, Retention
from relay.engine.encoding import RecordEncoder
from relay.engine.worker import PartWorker
from relay.errors import DatabaseUnavailable, RelayError, RetryableError
from relay.observability.tracing import Tracing
from relay.ops.subscribers import Setup, load_schemas
from relay.ops.subscribers import sync as sync_subscribers

if TYPE_CHECKING:
    import psycopg

    from relay.adapters.postgres.pool import RelayPool
    from relay.adapters.postgres.probe import CommitProbe

logger = logging.getLogger(__name__)

_HORIZON_CHECK_EVERY_S = 30.0
# A part waiting for a right the relay's own credentials lack (a Postgres privilege, a
# Kafka ACL) makes the relay unready (#48): such a relay cannot do its work, and a new
# pod with credentials that may is ready. A missing topic, a full topic budget or an
# unreachable registry leave it ready: every replica, old or new, waits alike.
_UNREADY_WAITS = frozenset({"postgres_privilege", "kafka_acl"})
# How many waiting parts /readyz names per cause.
_WAITS_NAMED = 5
_START_CONNECT_TIMEOUT_S = 5.0
# The supervisor's shortest wait: one that wakes just before Kafka's silence reaches the
# session timeout does not spin.
_MIN_TICK_S = 0.05


class Relay:
    """Publishes every committed outbox event for every subscriber until stopped."""

    def __init__(self, settings: Settings, *, registry: SchemaFolder | None = None) -> None:
        self.settings = settings
        self.database_url = settings.require_database_url()
        self.bootstrap_servers = settings.require_bootstrap_servers()
        self.registry = registry if registry is not None else load_schemas(settings)
        allow = None if settings.topic_allow is None else re.compile(settings.topic_allow)
        self.topic_guard = TopicGuard(settings.checkpoint_topic, allow)
        schema_registry = wiring.registry_encoder(settings, self.registry)
        self.schema_registry = schema_registry
        self.encoder = RecordEncoder(self.registry, self.topic_guard, schema_registry)
        self._stopping = threading.Event()
        # Wakes the supervisor before its tick: a peer's session expired, or stopping.
        self._tick = threading.Event()
        self._stop_requested = threading.Event()
        # Kafka's partitioner, for the spans' partitions: closed at stop.
        self.partitioner = wiring.key_partitioner(settings)
        self.tracing = Tracing.start(settings, self.partitioner)  # off: no OpenTelemetry
        self.encoder = self.tracing.wrap(self.encoder)
        self._probe: CommitProbe | None = None
        self._pool: RelayPool | None = None
        self._supervisor: threading.Thread | None = None
        self.http: HealthServer | None = None
        # The outbox's record of its topics, on this process's pool (issue #47).
        self.topic_record = wiring.topic_record(self._connection, settings.database_schema)
        admin = wiring.shared_admin(settings)
        self.publishers = wiring.publishers(settings, self.topic_guard, self.topic_record, admin)
        context = DaemonContext(settings, self._open_store, self._stopping)
        self.membership = Membership(
            context,
            admin,
            on_lost=self._abandon_workers,
            stop_workers=self._stop_all_workers,
            written_topics=self.publishers.written_topics,
            on_peer_expired=self._tick.set,
        )
        self.parts = ClaimedParts(
            context,
            self.membership,
            topic_guard=self.topic_guard,
            encoder=self.encoder,
            open_publisher=self.publishers,
            tracing=self.tracing,
        )
        self.key_space = KeySpaceChecks()
        # Its subscribers are defined and checked as `subscribers add` does.
        self.setup = Setup(
            settings, self.registry, wiring.registry_check(schema_registry), wiring.partition_room
        )
        self.retention = Retention(settings, self.membership, self.key_space)
        self.horizon = HorizonWatch(settings)

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
        if self._pool is None or self._pool.closed:
            self._pool = wiring.relay_pool(self.settings, self._check_key_space)
        if self.settings.metrics_enabled and self.http is None:
            self.http = HealthServer(self, self._open_store, self.settings)
            self.http.start()
        # Not the pool's 30 s: a relay that cannot reach Postgres says so soon, and
        # start_with_retries keeps trying (and stops at once when told to).
        try:
            with self._pool.connection(timeout=_START_CONNECT_TIMEOUT_S) as conn:
                store = wiring.store_on(conn, self.settings.database_schema)
                check_schema(conn, self.settings.database_schema)
                self.key_space.check(store, "start-up")
                sync_subscribers(self.setup, store)
                subscribers = [s.subscriber for s in store.list()]
            adopt_topics(self.settings, self.topic_guard, self.topic_record, subscribers)
        except DatabaseUnavailable as exc:
            # The pool retries every refusal; one no retry can fix ends the start.
            permanent = self._pool.permanent_refusal()
            if permanent is None:
                raise
            raise permanent from exc
        self.membership.start()
        self._probe = wiring.commit_probe(self._pool, self.settings, self.parts.wake, self.parts)
        self._probe.start()
        self._rebalance_safely()
        self._supervisor = threading.Thread(
            target=self._supervise, name="relay-supervisor", daemon=True
        )
        self._supervisor.start()
        session = self.membership.session
        session_id = None if session is None else session.id
        logger.info(
            "relay started (session %s) with parts %s",
            session_id,
            sorted(str(p) for p in self.workers),
            extra=log_extra("relay_started", session=session_id),
        )

    def stop(self, timeout: float | None = None) -> None:
        """Finish (or abandon, unacknowledged) each batch in flight, release every
        claim, and return within ``timeout`` seconds (``shutdown_timeout`` by default)."""
        deadline = time.monotonic() + (
            self.settings.shutdown_timeout if timeout is None else timeout
        )
        self._stopping.set()
        self._tick.set()
        self._stop_requested.set()
        if self._supervisor is not None:
            self._supervisor.join(max(0.0, deadline - time.monotonic()))
        self._stop_all_workers(deadline)
        if self._probe is not None:
            self._probe.stop()
        self.membership.stop(deadline)
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self._probe is not None:
            self._probe.join(max(0.0, min(2.0, deadline - time.monotonic())))
        self._close_pool()
        self.tracing.flush()
        self.partitioner.close()
        logger.info("relay stopped", extra=log_extra("relay_stopped"))

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (safe in a signal handler: it only sets a flag)."""
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`request_stop` or :meth:`stop`; True if asked to stop."""
        return self._stop_requested.wait(timeout)

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- observability ---------------------------------------------------------------

    @property
    def workers(self) -> dict[PartId, PartWorker]:
        """The running worker of each part this relay claims."""
        return self.parts.workers

    def part_totals(self) -> dict[PartId, Counter[str]]:
        """Cumulative statistics per part, over every worker this process has run."""
        return self.parts.totals()

    def key_space_changes(self) -> Counter[str]:
        """Moves of the database found by this process, by what was done about them."""
        found = Counter(self.key_space.changes)
        for totals in self.part_totals().values():
            found["rebased"] += totals["key_space_rebased"]
            found["continued"] += totals["key_space_continued"]
        return found

    def retention_totals(self) -> Counter[str]:
        """Rows this process pruned, and its retention passes that failed."""
        return Counter(self.retention.totals)

    def part_states(self) -> dict[PartId, str]:
        return self.parts.states()

    def part_waits(self) -> dict[PartId, str]:
        return self.parts.waits()

    def healthy(self) -> tuple[bool, str]:
        """Liveness: the threads that keep the relay going are alive."""
        threads = (("supervisor", self._supervisor), ("session", self.membership.keeper))
        for name, thread in threads:
            if thread is not None and not thread.is_alive() and not self._stopping.is_set():
                return False, f"the {name} thread died"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Readiness: a live session, so this relay can own and publish parts.

        A halted part leaves the relay ready: the halt is in Postgres, so every replica
        (and a new one rolled out with the fix) would be unready too, blocking the
        rollout that could fix it. Halts are alerted on from /metrics instead
        (deploy/README.md); the reply names them for whoever looks. So do parts waiting
        for an unreachable schema registry, a topic to be created or room for topics, as
        parts waiting for a partition's leader: every replica would wait alike
        (outbox_relay_part_waiting shows them). A part waiting for a privilege or an ACL
        the relay lacks makes it unready (_UNREADY_WAITS), as a heartbeat refused does.
        """
        if self._stopping.is_set():
            return False, "stopping"
        broker, session = self.membership.broker, self.membership.session
        if session is None:
            if broker is not None and broker.reachable is False:
                return False, f"no parts: {broker.describe()}"
            return False, "starting (waiting for Postgres or Kafka?)"
        if not session.valid():
            keeper = self.membership.keeper
            failed = None if keeper is None else keeper.last_error
            if failed is not None:  # says "permanent" when no retry can fix it
                return False, f"no live session: {failed}"
            return False, "no live session (Postgres unreachable?)"
        halted = sorted(str(p) for p, s in self.part_states().items() if s == WorkerState.HALTED)
        # Still ready: a partition without a leader stalls every relay alike (broker_watch).
        leaderless = broker is not None and broker.reachable and broker.leaderless
        waits = self.part_waits()
        reply = (
            f"session {session.id}, {len(self.workers)} parts"
            + (f"; halted: {', '.join(halted)}" if halted else "")
            + "".join(self._waits(on, parts) for on, parts in _by_cause(waits).items())
            + (f"; {broker.describe()}" if broker is not None and leaderless else "")
        )
        if _UNREADY_WAITS.intersection(waits.values()):
            return False, (
                "parts wait for a right the relay's role or principal lacks, and publish "
                f"once it is granted: {reply}"
            )
        return True, f"ready: {reply}"

    def _waits(self, waits_on: str, parts: list[PartId]) -> str:
        """ "; waiting for ...": the parts that wait on ``waits_on``, and why."""
        named = ", ".join(map(str, parts[:_WAITS_NAMED])) + (
            f" and {len(parts) - _WAITS_NAMED} more" if len(parts) > _WAITS_NAMED else ""
        )
        if waits_on == "schema_registry":
            down = None if self.schema_registry is None else self.schema_registry.unreachable
            why = ""
            if down is not None:
                why = f" (unreachable since {down[0].isoformat(timespec='seconds')}: {down[1]})"
            return f"; waiting for the schema registry{why}: {named}"
        worker = self.workers.get(parts[0])
        error = None if worker is None else worker.stats.last_error
        return f"; waiting for {waits_on}: {named}" + (f" ({error})" if error else "")

    # -- supervision -------------------------------------------------------------------

    def _supervise(self) -> None:
        store: DaemonStore | None = None
        last_horizon_check = 0.0
        last_prune = time.monotonic()  # not right at start-up: let the relays settle
        while not self._ticked():
            try:
                self.membership.mind_broker()
                store = store if store is not None and not store.closed else self._open_store()
                self.parts.rebalance(store)
                if time.monotonic() - last_horizon_check > _HORIZON_CHECK_EVERY_S:
                    last_horizon_check = time.monotonic()
                    self.horizon.check(store)
                every = self.settings.prune_every
                if every and time.monotonic() - last_prune > every:
                    last_prune = time.monotonic()
                    self.retention.prune(store)
            except RelayError as exc:  # the workers report their own errors; keep going
                logger.warning(
                    "rebalance failed: %s", exc, extra=log_extra("rebalance_failed", error=exc)
                )
                if store is not None:
                    store.close()
                store = None
        if store is not None:
            store.close()

    def _ticked(self) -> bool:
        """Wait for the supervisor's next tick; True once the relay is stopping."""
        self._tick.wait(self._next_tick())
        self._tick.clear()
        return self._stopping.is_set()

    def _next_tick(self) -> float:
        """The supervisor's wait: a heartbeat interval, or less when Kafka's silence
        reaches the session timeout sooner (a takeover waits for no tick, issue #49)."""
        until = self.membership.until_giving_up()
        return max(_MIN_TICK_S, min(self.settings.heartbeat_interval, until))

    def _rebalance_safely(self) -> None:
        try:
            store = self._open_store()
            try:
                self.parts.rebalance(store)
            finally:
                store.close()
        except RetryableError as exc:
            logger.warning(
                "first rebalance failed, the supervisor retries: %s",
                exc,
                extra=log_extra("rebalance_failed", error=exc, first=True),
            )

    def _abandon_start(self) -> None:
        self._abandon_workers()
        if self._probe is not None:
            self._probe.stop()
            self._probe = None
        self.membership.abandon()
        self._close_pool()

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _abandon_workers(self) -> None:
        self.parts.abandon()

    def _stop_all_workers(self, deadline: float | None = None) -> None:
        self.parts.stop_all(deadline)

    def _check_key_space(self, store: PartStore) -> None:
        self.key_space.check(store, "a new connection")

    def _connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection of this process's pool, borrowed for a ``with`` block."""
        if self._pool is None:
            raise DatabaseUnavailable("the relay is not running")
        return self._pool.connection()

    def _open_store(self) -> StatusStore:
        """A store on this process's pool: its calls borrow connections (relay/adapters/postgres/pool.py)."""
        if self._pool is None:
            raise DatabaseUnavailable("the relay is not running")
        return self._pool.store(self.settings.database_schema)


def _by_cause(waits: dict[PartId, str]) -> dict[str, list[PartId]]:
    """The waiting parts by what they wait on, each list in order."""
    causes: dict[str, list[PartId]] = {}
    for part, waits_on in sorted(waits.items()):
        causes.setdefault(waits_on, []).append(part)
    return causes


class Startable(Protocol):
    def start(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def start_with_retries(relay: Startable) -> None:
    """Postgres or Kafka down at start-up is transient: wait for them, never give up."""
    delay = 0.5
    while True:
        try:
            relay.start()
            return
        except RetryableError as exc:
            logger.warning(
                "cannot start yet: %s; retrying in %.0fs",
                exc,
                delay,
                extra=log_extra("relay_start_retrying", error=exc, retry_in=delay),
            )
            if relay.wait(delay):
                return  # stopped (SIGTERM) while waiting
            delay = min(delay * 2, 30.0)


def tune_process() -> None:
    """Tune the process for publishing (process-wide: the CLI's call, and each worker
    process's): the garbage collector, then the C allocator, which cannot be put back
    (a benchmark that restores what it tuned takes :func:`tune_gc` alone)."""
    tune_gc()
    _tune_malloc()


def tune_gc() -> None:
    """Make the cyclic garbage collector run less often.

    Publishing allocates tens of thousands of short-lived, acyclic objects per batch,
    which reference counting frees; at the default thresholds the collector still walks
    the young generations every 700 allocations, about a fifth of the relay's CPU time.
    Objects from start-up (modules, settings) are frozen out of the walks altogether.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# mallopt's parameter for the largest request its fastbins serve (glibc's malloc.h).
_M_MXFAST = 1


def _tune_malloc() -> None:
    """Turn glibc's fastbins off (mallopt(M_MXFAST, 0)).

    Each batch frees buffers over 64 KiB (the fetch's result, librdkafka's produce
    requests), and every such free makes glibc first merge all its fastbins, the
    thousands of small blocks a batch's messages freed: 4% of the relay's CPU in
    `perf` (issue #53), gone with them off; the per-thread caches still serve small
    blocks. Where the C library has no mallopt (not glibc), nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MXFAST, 0)
