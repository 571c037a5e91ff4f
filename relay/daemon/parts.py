"""Claims and workers: this relay's share of the parts, with one worker per claimed part.
The workers take turns on a few threads and borrow a few producers (relay/engine/scheduling.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from uuid import UUID

from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import DaemonStore, PartState, Publisher
from relay.core.subscribers import TopicGuard
from relay.core.worker_stats import WorkerState
from relay.daemon.context import DaemonContext
from relay.daemon.membership import Membership
from relay.engine.encoding import RecordEncoder
from relay.engine.scheduling import PartScheduler, ProducerPool
from relay.engine.sessions import assign
from relay.engine.worker import PartWorker
from relay.errors import RelayError
from relay.observability.tracing import Tracing

logger = logging.getLogger(__name__)

_IDLE_PRODUCER_S = 30.0


class ClaimedParts:
    """Claims this relay's share of the parts, runs a worker per claim, releases the rest
    (docs/design.md §4), and keeps every worker's statistics, stopped ones included."""

    def __init__(
        self,
        context: DaemonContext,
        membership: Membership,
        *,
        topic_guard: TopicGuard,
        encoder: RecordEncoder,
        open_publisher: Callable[[PartState], Publisher],
        tracing: Tracing | None = None,
    ) -> None:
        self._ctx = context
        self._tracing = tracing if tracing is not None else Tracing()
        self._membership = membership
        self._topic_guard = topic_guard
        self._encoder = encoder
        self._open_publisher = open_publisher
        limit = context.settings.max_producers
        self.scheduler = PartScheduler(limit)
        self.producers = ProducerPool(open_publisher, limit)
        self.workers: dict[PartId, PartWorker] = {}
        # Each claimed part's aggregate types (None: any), so that a change of one type
        # wakes only the parts that can have rows of it.
        self._types: dict[PartId, frozenset[str] | None] = {}
        # Statistics of workers that have stopped, so counters never go down.
        self._retired: dict[PartId, Counter[str]] = {}
        # Workers this relay told to stop; any other that ends did so on its own.
        self._told_to_stop: set[PartWorker] = set()
        # Set when a worker starts waiting for news: the commit probe sleeps while none
        # waits (a busy part polls again by itself) and looks as soon as one does.
        self._part_waits = threading.Event()

    # -- statistics --------------------------------------------------------------------

    def totals(self) -> dict[PartId, Counter[str]]:
        """Cumulative statistics per part, over every worker this process has run."""
        totals = {part: Counter(c) for part, c in self._retired.items()}
        for part, worker in list(self.workers.items()):
            totals.setdefault(part, Counter()).update(_counts(worker))
        return totals

    def states(self) -> dict[PartId, str]:
        return {part: w.stats.state.value for part, w in list(self.workers.items())}

    def waits(self) -> dict[PartId, str]:
        """The parts waiting for an unreachable service, and which (schema_registry,
        kafka, postgres)."""
        waits = {part: w.stats.waiting_on for part, w in list(self.workers.items())}
        return {part: on for part, on in waits.items() if on is not None}

    def wake(self, aggregate_types: frozenset[str] | None = None) -> None:
        """Wake the workers whose parts can have rows of ``aggregate_types`` (None: any:
        every worker)."""
        for part, worker in list(self.workers.items()):
            wanted = self._types.get(part)
            if aggregate_types is None or wanted is None or not wanted.isdisjoint(aggregate_types):
                worker.wake()

    def waiting(self) -> bool:
        """Whether some worker's last poll found nothing new (a wake-up can help it)."""
        return any(worker.waiting for worker in list(self.workers.values()))

    def wait_for_waiting(self, timeout: float) -> None:
        """Return once a worker may have started waiting since the last call, or after
        ``timeout`` seconds; the caller checks :meth:`waiting` next."""
        self._part_waits.wait(timeout)
        # Cleared before the caller's check: a worker that starts waiting later sets it
        # again (after its flag), so the next call returns at once.
        self._part_waits.clear()

    # -- rebalancing -------------------------------------------------------------------

    def rebalance(self, store: DaemonStore) -> None:
        """Match claims and workers to this relay's share of the parts."""
        subscribers = store.list()
        self._topic_guard.update(s.subscriber for s in subscribers)
        # A part idle this long gives its producer up (it recovers when it has rows).
        self.producers.close_idle(older_than=_IDLE_PRODUCER_S)
        parts = {PartId(p.name, p.part): p for s in subscribers for p in s.parts}
        self._types = {part: p.subscriber.aggregate_types for part, p in parts.items()}
        for part, worker in list(self.workers.items()):
            if not worker.is_alive():
                halted = part in parts and parts[part].halted_error is not None
                self._retire(part, worker, store, halted)  # lost claim, removed subscriber...
        session = self._membership.session
        if session is None:  # no session (Kafka unreachable): no share
            return
        me = session.id
        owners = {part: p.owner for part, p in parts.items()}
        mine = {
            p for p, owner in assign(list(owners), store.live_sessions()).items() if owner == me
        }
        self._release(store, owners, mine, me)
        current = self._membership.session  # the keeper may have opened a new one
        if self._ctx.stopping.is_set() or current is None or not current.valid():
            return
        for part in sorted(mine):
            if part in self.workers:
                continue
            if owners[part] is None and store.claim(part.subscriber, part.part, me):
                logger.info("claimed part %s", part, extra=log_extra("part_claimed", part=part))
            elif owners[part] != me:
                continue  # still owned by a peer, which releases it on its next round
            self._start_worker(part)

    def _release(
        self, store: DaemonStore, owners: dict[PartId, UUID | None], mine: set[PartId], me: UUID
    ) -> None:
        """Stop the workers of parts a peer should own; release those claims once the
        worker is gone."""
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
                logger.info(
                    "released part %s to a peer", part, extra=log_extra("part_released", part=part)
                )

    # -- workers -----------------------------------------------------------------------

    def _start_worker(self, part: PartId) -> None:
        session = self._membership.session
        assert session is not None
        worker = PartWorker(
            part,
            session=session,
            open_store=self._ctx.open_store,
            open_publisher=self._open_publisher,
            scheduler=self.scheduler,
            producers=self.producers,
            encoder=self._encoder,
            batch_size=self._ctx.settings.batch_size,
            batch_max_bytes=self._ctx.settings.batch_max_bytes,
            max_record_bytes=int(self._ctx.settings.kafka.get("message.max.bytes", 1_000_000)),
            poll_interval=self._ctx.settings.poll_interval,
            hook=self._tracing.hook(),
            on_wait=self._part_waits.set,
        )
        self.workers[part] = worker
        worker.start()

    def abandon(self) -> None:
        """The session is gone: every worker stops at once (without waiting for them,
        so the keeper can open a new session and heartbeat it)."""
        for worker in list(self.workers.values()):
            self._stop_worker(worker)

    def stop_all(self, deadline: float | None = None) -> None:
        """Stop every worker; wait for each until ``deadline`` (shutdown_timeout from now)."""
        workers = list(self.workers.values())
        for worker in workers:
            self._stop_worker(worker)
        end = (
            deadline
            if deadline is not None
            else time.monotonic() + self._ctx.settings.shutdown_timeout
        )
        for worker in workers:
            worker.join(max(0.0, end - time.monotonic()))
            if worker.is_alive():
                logger.warning(
                    "part %s did not finish its batch in time",
                    worker.part,
                    extra=log_extra("part_stop_overdue", part=worker.part),
                )
        # The threads end once no turn is due; a later start begins them again.
        self.scheduler.close()
        self.producers.close_idle()

    def _stop_worker(self, worker: PartWorker) -> None:
        self._told_to_stop.add(worker)
        worker.stop()

    def _retire(self, part: PartId, worker: PartWorker, store: DaemonStore, halted: bool) -> None:
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

    def _record_failure(self, store: DaemonStore, part: PartId, worker: PartWorker) -> None:
        """A worker stopped on an error that retrying cannot fix (a missing privilege, a
        refused Kafka setting). Halt the part in Postgres, as a poison event does: the
        next worker waits for `subscribers resume` instead of failing in a silent loop,
        and `status`, /metrics and every relay show why."""
        error = f"part worker stopped: {worker.stats.last_error}"
        unrecorded = self._halt(store, part, error)
        if unrecorded is not None:
            logger.warning(
                "part %s stopped: %s (its halt is not recorded: %s)",
                part,
                error,
                unrecorded,
                extra=log_extra("part_halt_unrecorded", part=part, error=error),
            )
            return
        logger.error(
            "part %s halted (`outbox-relay subscribers resume %s` retries it): %s",
            part,
            part.subscriber,
            error,
            extra=log_extra("part_worker_failed", part=part, error=error),
        )

    def _halt(self, store: DaemonStore, part: PartId, error: str) -> str | None:
        """Halt ``part`` in Postgres; None when done, else why it could not be."""
        session = self._membership.session
        if session is None:  # gave its session up meanwhile: the claim is gone too
            return "no session"
        try:
            store.halt(store.get_part(*part), session.id, error)
        except RelayError as exc:
            return str(exc)
        return None


def _counts(worker: PartWorker) -> Counter[str]:
    counts = worker.stats.counts()  # "failures" is counted when a worker is retired
    counts.update(worker.hook.counts())
    return counts
