"""One subscriber part's publication loop: fetch → encode → publish → checkpoint.

A claimed part runs in turns on one of the relay's few scheduler threads, and borrows
one of its few Kafka producers while it publishes (relay/engine/scheduling.py): an idle part
holds neither. A slow or halted part never stalls the others; its store borrows one of
the process's few Postgres connections per query (relay/adapters/postgres/pool.py). Whenever the part gets
a producer it has not recovered with, the worker first runs recovery (docs/design.md §5):
fence earlier producers of the part, then move the Postgres checkpoint up to the
Kafka-side one if a transaction committed there without its checkpoint update reaching
Postgres.

This module is the loop: turns, steps, recovery and retries, and the part's state
between batches. What becomes of one batch (encoded, sent, blamed, recorded) is
relay/engine/batch_publisher.py's, told back as a value (``Committed`` or ``Halted``)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from relay.core.key_space import KeySpace, adoptable
from relay.core.log_fields import log_extra
from relay.core.log_sampling import SampledLog
from relay.core.model import KafkaCheckpoint, PartId, Position
from relay.core.ports import (
    DeadLetter,
    DeadLetterDecision,
    PartState,
    PartStore,
    Publisher,
    Selection,
)
from relay.core.publish_hook import NoHook, PublishHook
from relay.core.worker_stats import WorkerState, WorkerStats
from relay.engine.batch_publisher import (
    BatchPublisher,
    Committed,
    Halted,
    PartBatch,
    PartReader,
    record_error,
)
from relay.engine.encoding import RecordEncoder
from relay.engine.scheduling import PartScheduler, ProducerPool
from relay.engine.sessions import RelaySession
from relay.engine.waiting import WaitRecord
from relay.errors import (
    CheckpointConflict,
    ClaimLost,
    RelayError,
    RetryableError,
    SubscriberError,
)

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
# After a notification finds nothing decided yet (an older transaction still holds the
# horizon), re-poll soon rather than waiting out the whole poll interval.
_HORIZON_REPOLL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
# How long a busy part's turn goes on while other parts wait for a thread. Long enough
# that a part that had to wait for a producer (init_transactions and recovery: hundreds
# of ms) publishes many batches with it; short enough that waiting parts are served.
_TURN_S = 2.0
# What a decision recovered from the Kafka-side checkpoint says (its reason is on the
# dead-letter record, in the header outbox.error).
_RECOVERED = "dead-lettered by a previous owner (recorded by recovery; the reason is on the record)"


@dataclass(frozen=True, slots=True)
class Unstarted:
    """(Re)started: nothing read yet. The part's key space and recovery come first."""


@dataclass(frozen=True, slots=True)
class Unloaded:
    """Recovered, its state to be read again before the next batch (after a batch that
    halted, a pause, or a recovery that moved the checkpoint)."""

    space: KeySpace | None


@dataclass(frozen=True, slots=True)
class Loaded:
    """The part's state as this worker left it. ``ahead``: the next batch, read while
    the last travelled. ``idle``: the last step found nothing and waited, so an idle
    tick reads the state again (a pause, a reset) before polling."""

    space: KeySpace | None
    state: PartState
    ahead: PartBatch | None = None
    idle: bool = False


# Where a part's publication stands between two steps: one value, replaced as a whole.
Progress = Unstarted | Unloaded | Loaded


class PartWorker:
    """One part's publication, run in turns by a :class:`PartScheduler`: a turn polls
    the part and, when it has rows, borrows a producer from the :class:`ProducerPool`
    and publishes until the part is caught up (or, when other parts wait for a
    thread, for about ``_TURN_S``). Between turns an idle part holds no thread and no
    producer; its publisher may stay open in the pool until another part needs room.

    Without a scheduler and a pool of its own (tests, one part) the worker makes a
    private one-thread scheduler and a one-producer pool over ``open_publisher``."""

    def __init__(
        self,
        part: PartId,
        *,
        session: RelaySession,
        open_store: Callable[[], PartStore],
        open_publisher: Callable[[PartState], Publisher],
        encoder: RecordEncoder,
        batch_size: int,
        poll_interval: float,
        batch_max_bytes: int = 2**62,
        max_record_bytes: int = 2**61,
        hook: PublishHook | None = None,
        scheduler: PartScheduler | None = None,
        producers: ProducerPool | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        # Called when :attr:`waiting` turns true: the commit probe looks for news only
        # while some part waits for it.
        self._on_wait = on_wait
        # Told of each committed batch: the latency histogram, and spans if tracing is on.
        self.hook: PublishHook = hook if hook is not None else NoHook()
        self.part = part
        self.session = session
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._ended = threading.Event()
        self._open_store = open_store
        self._own_scheduler = scheduler is None
        self._scheduler = scheduler if scheduler is not None else PartScheduler(1)
        self._producers = producers if producers is not None else ProducerPool(open_publisher, 1)
        # What every fetch of this part reads at most; the subscriber's parts and filters
        # join it per fetch (a subscriber read again may filter differently). A row over
        # twice the largest record (message.max.bytes) cannot fit in one, whatever the
        # format (JSON text as Postgres writes it is at most about twice as long as the
        # compact JSON published): it is poison, and never read.
        limits = Selection(
            batch_size, batch_max_bytes, part.part, max_row_bytes=2 * max_record_bytes
        )
        self._poll_interval = poll_interval
        self._store: PartStore | None = None
        self._progress: Progress = Unstarted()
        self._repolls: Iterator[float] = iter(())
        self._caught_up = False  # the last fetch found nothing new (idle polls keep it)
        self._failures = 0
        self._outage = _Outage(part, self.stats)
        # What it waits for, as its checkpoint row says it for `status` (issue #48).
        self._wait_record = WaitRecord(part, session.id)
        # Poison warnings, sampled: a flood of poison rows logs a few, then a summary.
        self._poison_log = SampledLog(
            logger,
            f"part {part}: %d more poison events in the last %.0f s were not logged one by "
            "one (`outbox-relay dead-letters list` shows the dead letters)",
            self._sampled_out,
        )
        self._reader = PartReader(part, session=session, stats=self.stats, limits=limits)
        # One batch's fate: encoded, sent, blamed, recorded.
        self._batches = BatchPublisher(
            part,
            session=session,
            stats=self.stats,
            encoder=encoder,
            reader=self._reader,
            hook=self.hook,
            poison_log=self._poison_log,
        )

    # -- what the relay calls ------------------------------------------------------------

    def start(self) -> None:
        self._scheduler.submit(self)

    def stop(self) -> None:
        """Finish the batch in flight, then stop."""
        self._stopping.set()
        self._scheduler.wake(self)

    def wake(self) -> None:
        """Something may have been committed for this part: poll it soon."""
        self._scheduler.wake(self)

    @property
    def waiting(self) -> bool:
        """Whether its last poll found nothing new: only then can :meth:`wake` help it
        (a part with a backlog polls again by itself)."""
        return self._caught_up

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    # -- a turn ------------------------------------------------------------------------

    def turn(self, woken: bool) -> float | None:
        """Run one turn (on a scheduler thread); returns the seconds until the next one,
        or None once the worker has stopped."""
        if not self._stopping.is_set():
            try:
                delay = self._serve(woken)
                if self.stats.waiting_on is not None:
                    self._outage.over()
                self._wait_record.done(self._held_store)
            except RetryableError as exc:
                self._failures += 1
                delay = self._retry_later(exc, self._failures)
            except ClaimLost as exc:
                logger.warning(
                    "part %s: %s; stopping its worker",
                    self.part,
                    exc,
                    extra=self._log_extra("part_claim_lost", error=exc),
                )
                self._stopping.set()
            except SubscriberError:
                logger.info(
                    "part %s: its subscriber was removed; stopping",
                    self.part,
                    extra=self._log_extra("part_subscriber_removed"),
                )
                self._stopping.set()
            except RelayError as exc:
                if exc.waits_on is None:
                    self._stop_on(exc)
                else:
                    # Fatal to a command, but it heals (a privilege granted again, #48):
                    # a running part waits for it, as for an outage, and never halts.
                    self._failures += 1
                    delay = self._retry_later(exc, self._failures)
            except Exception as exc:
                # Not ours: a bug, or a failure no one foresaw. The part must not die of
                # it (the supervisor would restart it in a silent loop).
                self._failures += 1
                with self.stats.lock:
                    self.stats.unexpected += 1
                delay = self._retry_later(exc, self._failures, unexpected=True)
            if not self._stopping.is_set():
                return delay
        self._finish()
        return None

    def _stop_on(self, exc: RelayError) -> None:
        """Not retryable, healing by no fix of its own and not an event's fault (a bad
        Kafka setting...): stop this part only, loudly."""
        self._record_error(WorkerState.HALTED, exc)
        logger.error(
            "part %s stopped: %s",
            self.part,
            exc,
            extra=self._log_extra("part_stopped", error=exc),
        )
        self._stopping.set()

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this part's log lines: the event, the part, then ``fields``."""
        return log_extra(event, part=self.part, **fields)

    def _sampled_out(self, count: int) -> dict[str, object]:
        """The ``extra`` of the line that sums up ``count`` poison warnings left out."""
        return self._log_extra("poison_warnings_sampled_out", count=count)

    def _finish(self) -> None:
        self._poison_log.flush()
        try:
            self._drop_connections()
        finally:
            if self.stats.state is not WorkerState.HALTED:
                self.stats.state = WorkerState.STOPPED
            if self._own_scheduler:
                self._scheduler.close()
            self._ended.set()

    def _retry_later(self, exc: Exception, failures: int, *, unexpected: bool = False) -> float:
        delay: float = min(_MAX_BACKOFF_S, 0.1 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0)
        waits_on = self._outage.failed(exc, delay, unexpected)
        if waits_on is not None:
            self._wait_record.waiting(self._held_store, waits_on, str(exc))
        # Start over from recovery: the transaction's fate may be unknown.
        self._drop_connections()
        return delay

    # -- the loop ----------------------------------------------------------------------

    def _serve(self, woken: bool) -> float:
        """Publish until the part is caught up, stopping, or its turn is up while
        other parts wait; returns the seconds until its next turn. Raises on errors."""
        store = self._held_store()
        if isinstance(self._progress, Unstarted):  # before anything else on this part
            space = self._reader.key_space(store)
            # Recover at once, as a part is taken over: earlier owners are fenced now,
            # not when the first row comes, and a producer Kafka refuses shows at once.
            _, recovered = self._lend_publisher(store, self._reader.load(store), space)
            self._progress = Unloaded(space) if recovered is None else Loaded(space, recovered)
        ends = time.monotonic() + _TURN_S
        try:
            while True:
                # The turn's last step when others wait for a thread: it reads nothing
                # ahead, since a batch kept until the next turn is memory held by every
                # waiting part at once (hundreds of busy parts on a few threads).
                last = time.monotonic() > ends and self._scheduler.contended()
                delay = self._step(store, woken, read_ahead=not last)
                woken = False
                if delay is not None:
                    return delay
                if self._stopping.is_set() or last:
                    return 0.0  # stopping, or others wait: this part goes on next turn
        finally:
            # Between turns the pool may close it.
            self._producers.release(self)

    def _step(self, store: PartStore, woken: bool, *, read_ahead: bool) -> float | None:
        """Publish one batch (None: go on), or say how long to wait for the next;
        ``read_ahead``: read the batch after it while it travels."""
        progress = self._progress
        assert not isinstance(progress, Unstarted)  # _serve started it
        space = progress.space
        match progress:
            case Loaded(state=known, ahead=ahead, idle=idle) if not (idle and not woken):
                state = known
            case Loaded(state=known):  # an idle tick's: a pause or a reset shows
                state, ahead = self._reload(store, known), None
            case Unloaded():
                state, ahead = self._reload(store, None), None
        if state.subscriber.paused or state.halted_error is not None:
            self.stats.state = WorkerState.HALTED if state.halted_error else WorkerState.PAUSED
            self._progress = Unloaded(space)
            return self._poll_interval
        if self.stats.waiting_on is None:  # a waiting part stays 'retrying' until it is not
            self.stats.state = WorkerState.RUNNING
        batch = ahead if ahead is not None and ahead.end else self._reader.fetch(store, state)
        if batch.end is None:
            self._progress = Loaded(space, state, idle=True)
            return self._caught_up_wait(woken)
        self._caught_up = False
        if not batch.events:
            # Only rows the subscriber does not take: the Postgres checkpoint alone moves,
            # and no producer is needed (what Kafka holds of the part stays as it is).
            self._progress = Loaded(space, self._batches.advance(store, state, batch.end, []))
            self._batches.count([], 0, batch.end)
            return None
        publisher, recovered = self._lend_publisher(store, state, space)
        if recovered is not None:
            if not _same_batch_start(recovered, state):
                self._progress = Unloaded(space)  # recovery moved the checkpoint: read again
                return None
            state = recovered
        match self._batches.publish(store, publisher, state, batch, read_ahead):
            case Committed(state=published, ahead=following):
                self._progress = Loaded(space, published, following)
                self._failures = 0
            case Halted():  # on a poison event, or the relay's configuration
                self._progress = Unloaded(space)
        return None

    def _caught_up_wait(self, woken: bool) -> float:
        """The part found nothing new: the seconds until it polls again."""
        self._poison_log.flush()  # caught up: a flood is over, say what was left out
        if woken:
            self._repolls = iter(_HORIZON_REPOLL_S)
        was_caught_up, self._caught_up = self._caught_up, True
        if not was_caught_up and self._on_wait is not None:
            self._on_wait()  # after the flag: the probe checks it once told
        return next(self._repolls, self._poll_interval)

    def _lend_publisher(
        self, store: PartStore, state: PartState, space: KeySpace | None
    ) -> tuple[Publisher, PartState | None]:
        """Borrow this part's publisher from the pool for this turn. One opened for it
        just now is recovered with first (fencing the part's earlier producers): then
        the part's state after recovery comes with it."""
        publisher, fresh = self._producers.acquire(self, state)
        if not fresh:
            return publisher, None
        with self.stats.lock:
            self.stats.producers_opened += 1
        # Ownership is read from Postgres right before init_transactions fences: a part
        # this relay no longer owns never gets a new producer (docs/design.md).
        current = self._reader.load(store)
        if not self.session.valid():
            raise ClaimLost("this relay's session may have expired; not recovering")
        return publisher, self._recover(store, publisher, current, space)

    def _recover(
        self, store: PartStore, publisher: Publisher, state: PartState, space: KeySpace | None
    ) -> PartState:
        """Fence earlier producers of this part and adopt a newer Kafka-side checkpoint,
        if it provably belongs to this database's history."""
        recovered = publisher.recover(
            str(state.generation), space.id if space is not None else None
        )
        logger.info(
            "part %s: resuming after %s (Kafka-side checkpoint: %s)",
            self.part,
            state.checkpoint,
            recovered.position if recovered is not None else None,
            extra=self._log_extra("part_resuming", checkpoint=state.checkpoint),
        )
        if recovered is None or recovered.position <= state.checkpoint:
            return state
        adopted: Position | None = recovered.position
        why = "no key space recorded"  # schema before migration 0004: no provenance
        if space is not None:
            adopted, why = adoptable(recovered, space, store.key_of, store.translate)
        if adopted is None:
            logger.warning(
                "part %s: Kafka holds checkpoint %s, Postgres %s, but it is not adopted: %s "
                "(the database was restored?); events after %s are published again",
                self.part,
                recovered.position,
                state.checkpoint,
                why,
                state.checkpoint,
                extra=self._log_extra("part_recovery_refused", recovered=recovered.position),
            )
            with self.stats.lock:
                self.stats.recoveries_refused += 1
            return state
        if adopted <= state.checkpoint:
            return state
        logger.warning(
            "part %s: Kafka holds checkpoint %s, Postgres %s: the last transaction "
            "committed without its checkpoint update; adopting %s (%s)",
            self.part,
            recovered.position,
            state.checkpoint,
            adopted,
            why,
            extra=self._log_extra("part_recovered", recovered=adopted),
        )
        with self.stats.lock:
            self.stats.recovered += 1
        letters = _recovered(store, state, space, adopted, recovered)
        return self._batches.advance(store, state, adopted, letters)

    def _reload(self, store: PartStore, known: PartState | None) -> PartState:
        """The part as stored now, ``known`` the state this worker last had of it.

        A checkpoint behind ``known``'s in the same generation was lost by Postgres (an
        asynchronous commit before a crash, docs/design.md §5) or restored (§6); going
        on from it would publish again what Kafka holds. The part starts over from
        recovery, which adopts Kafka's checkpoint."""
        state = self._reader.load(store)
        if (
            known is not None
            and state.generation == known.generation
            and state.checkpoint < known.checkpoint
        ):
            raise CheckpointConflict(
                f"part {self.part}: checkpoint went back from {known.checkpoint} "
                f"to {state.checkpoint} in the same generation"
            )
        return state

    def _held_store(self) -> PartStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def _drop_connections(self) -> None:
        """Forget everything read: the next turn starts over from recovery."""
        store, self._store = self._store, None
        self._progress = Unstarted()
        try:
            if store is not None:
                store.close()
        finally:
            self._producers.discard(self)

    def _record_error(self, state: WorkerState, exc: Exception) -> None:
        record_error(self.stats, state, exc)


class _Outage:
    """A part's failed attempts, told once per outage: the retries that follow for the
    same service, failing the same way, are counted (outbox_relay_errors, and the line
    when it is waited for no longer). Another kind of failure is logged: it may need
    someone."""

    def __init__(self, part: PartId, stats: WorkerStats) -> None:
        self.part, self.stats = part, stats
        # The service waited for and how it failed (waiting_on), and the attempts failed.
        self._waited: tuple[str, type[Exception]] | None = None
        self._failures = 0

    def failed(self, exc: Exception, delay: float, unexpected: bool) -> str | None:
        """Count and log an attempt that failed with ``exc``, retried in ``delay`` s;
        returns the service the part waits for, if it waits for one."""
        waits_on = exc.waits_on if isinstance(exc, RelayError) else None
        outage = None if waits_on is None else (waits_on, type(exc))
        again = outage is not None and outage == self._waited and self.stats.waiting_on is not None
        self._waited = outage
        self._failures = self._failures + 1 if again else 1
        record_error(self.stats, WorkerState.RETRYING, exc)
        logger.log(
            logging.ERROR if unexpected else logging.DEBUG if again else logging.WARNING,
            "part %s: %s%s; retrying in %.1fs",
            self.part,
            f"unexpected {type(exc).__name__}: " if unexpected else "",
            exc,
            delay,
            exc_info=exc if unexpected else None,
            extra=log_extra("part_retrying", part=self.part, retry_in=delay, error=exc),
        )
        return waits_on

    def over(self) -> None:
        """A turn went through after retries for an unreachable service: say so once,
        with how many retries the outage cost (logged at DEBUG after the first)."""
        service, self.stats.waiting_on = self.stats.waiting_on, None
        if self.stats.state is WorkerState.RETRYING:
            self.stats.state = WorkerState.RUNNING
        logger.info(
            "part %s: no longer waiting for %s, after %d attempts that failed",
            self.part,
            service,
            self._failures,
            extra=log_extra("part_waited", part=self.part, service=service, failed=self._failures),
        )


def _same_batch_start(recovered: PartState, fetched_at: PartState) -> bool:
    """Whether a batch fetched at ``fetched_at`` can still be published after recovery."""
    return (
        recovered.checkpoint == fetched_at.checkpoint
        and recovered.generation == fetched_at.generation
        and not recovered.subscriber.paused
        and recovered.halted_error is None
        and recovered.subscriber == fetched_at.subscriber
        and recovered.skips == fetched_at.skips
    )


def _recovered(
    store: PartStore,
    state: PartState,
    space: KeySpace | None,
    adopted: Position,
    recovered: KafkaCheckpoint,
) -> list[DeadLetter]:
    """The dead letters of the Kafka transaction whose checkpoint is adopted: their
    decisions, at their keys in this database (a rebase may have moved them)."""
    keys = [key for key, _ in recovered.dead_letters]
    if space is not None and recovered.key_space not in (None, space.id):
        keys = [store.translate(recovered.key_space, key) for key in keys]  # rebased since
    found = store.messages_at(keys) if keys else {}
    letters = [
        DeadLetter(key, found[key], DeadLetterDecision(topic, _RECOVERED))
        for key, (_, topic) in zip(keys, recovered.dead_letters, strict=True)
        if key in found and state.checkpoint < key <= adopted
    ]
    for message_id, topic in recovered.named_dead_letters:  # a relay before issue #47's
        key = store.key_of(message_id)
        if key is not None and state.checkpoint < key <= adopted:
            letters.append(DeadLetter(key, message_id, DeadLetterDecision(topic, _RECOVERED)))
    return letters
