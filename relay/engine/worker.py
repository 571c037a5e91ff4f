"""One subscriber part's publication loop: fetch → encode → publish → checkpoint.

A claimed part runs in turns on one of the relay's few scheduler threads, and borrows
one of its few Kafka producers while it publishes (relay/engine/scheduling.py): an idle part
holds neither. A slow or halted part never stalls the others; its store borrows one of
the process's few Postgres connections per query (relay/adapters/postgres/pool.py). Whenever the part gets
a producer it has not recovered with, the worker first runs recovery (docs/design.md §5):
fence earlier producers of the part, then move the Postgres checkpoint up to the
Kafka-side one if a transaction committed there without its checkpoint update reaching
Postgres."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from uuid import UUID

from relay.core import dead_letter_tag
from relay.core.key_space import KeySpace, KeySpaceAction, adoptable, report
from relay.core.log_fields import log_extra
from relay.core.log_sampling import SampledLog
from relay.core.model import KafkaCheckpoint, KafkaRecord, OutboxEvent, PartId, Position, Unreadable
from relay.core.ports import (
    Batch,
    DeadLetter,
    DeadLetterDecision,
    Extension,
    PartState,
    PartStore,
    Publisher,
    Selection,
)
from relay.core.publish_hook import NoHook, PublishHook
from relay.core.subscribers import PoisonPolicy, Subscriber
from relay.core.worker_stats import WorkerState, WorkerStats
from relay.engine.encoding import LOCAL_FORMATS, RecordEncoder
from relay.engine.poison import (
    MAX_DEAD_LETTER_ERROR_BYTES,
    MAX_STORED_ERROR_BYTES,
    cap,
    dead_letter_record,
)
from relay.engine.scheduling import PartScheduler, ProducerPool
from relay.engine.sessions import RelaySession
from relay.engine.waiting import WaitRecord
from relay.errors import (
    CheckpointConflict,
    ClaimLost,
    ConfigError,
    EncodingError,
    PoisonRecordError,
    RelayError,
    RetryableError,
    SubscriberError,
)

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
# After a notification finds nothing decided yet (an older transaction still holds the
# horizon), re-poll soon rather than waiting out the whole poll interval.
_HORIZON_REPOLL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
_ADVANCE_ATTEMPTS = 5
# How long a busy part's turn goes on while other parts wait for a thread. Long enough
# that a part that had to wait for a producer (init_transactions and recovery: hundreds
# of ms) publishes many batches with it; short enough that waiting parts are served.
_TURN_S = 2.0
# What a decision recovered from the Kafka-side checkpoint says (its reason is on the
# dead-letter record, in the header outbox.error).
_RECOVERED = "dead-lettered by a previous owner (recorded by recovery; the reason is on the record)"
# A record's size as the encoder counted it (KafkaRecord.size; -1: not counted).
_SIZE = itemgetter(KafkaRecord._fields.index("size"))


@dataclass(slots=True)
class _Batch:
    """A batch on its one way through the worker: the events a fetch read, then their
    records, then (once sent) what became of it: grown by a batch that joined it, with
    the batch read meanwhile for later, or refused by the broker. Per batch, never per
    event: the events and records lists are the only per-event objects it holds."""

    events: list[OutboxEvent]
    # How far the fetch read (past events the subscriber drops); None: nothing new.
    end: Position | None
    full: bool = False  # a backlog: the fetch came back full
    # Encoded ahead of time when every event encoded cleanly (or, on a dead-letter
    # subscriber, with ``decided``); None: encode on the slow path, which applies the
    # poison policy.
    records: list[KafkaRecord] | None = None
    ahead: _Batch | None = None  # read while this one travelled, for after it
    refused: PoisonRecordError | None = None  # the broker refused one of its records
    # Decided ahead of time on a dead-letter subscriber: the dead-letter decisions of
    # ``records`` (those recorded before included).
    decided: dict[UUID, DeadLetterDecision] | None = None
    # What a cut left (its dead letters reached what one transaction takes): the next
    # batch, already read (issue #47: each cut used to read the batch again).
    rest: _Batch | None = None

    def cut(self, used: int) -> None:
        """Keep the first ``used`` events; the others become :attr:`rest`."""
        self.rest = _Batch(self.events[used:], self.end, self.full)
        self.events, self.end, self.full = self.events[:used], self.events[used - 1].key, True


class _ReadAhead:
    """The publisher's ``meanwhile``: reads and encodes the batch after the one in
    flight while it travels. When the relay is caught up, that batch joins the open
    transaction rather than waiting a whole cycle for the next one."""

    def __init__(
        self,
        prepare: Callable[[PartState], _Batch],
        state: PartState,
        sent: _Batch,
        joining: Callable[[list[KafkaRecord]], list[KafkaRecord]],
    ) -> None:
        assert sent.end is not None
        self._prepare, self._state, self._end = prepare, state, sent.end
        self._joining = joining  # the records as they join (tracing: the batch's context)
        self._following: _Batch | None = None
        self._joined = False
        # A full batch means a backlog: what follows goes in its own full transaction,
        # so it is read while this one commits rather than offered to join it.
        self.may_join = not sent.full

    def __call__(self) -> Extension | None:
        following = self._prepare(dataclasses.replace(self._state, checkpoint=self._end))
        self._following = following
        if not self.may_join or not _joins(following, self._state):
            return None
        assert following.records is not None and following.end is not None
        self._joined = True
        following.records = self._joining(following.records)
        return following.records, following.end

    def grown(self, batch: _Batch) -> _Batch:
        """``batch`` with what joined it, or with what was read ahead for later."""
        following = self._following
        if following is None:
            return batch
        if not self._joined:
            batch.ahead = following
            return batch
        assert batch.records is not None and following.records is not None
        # New lists: the publisher may keep the ones it was handed.
        return _Batch(
            [*batch.events, *following.events],
            following.end,
            records=[*batch.records, *following.records],
        )


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
        self._encoder = encoder
        # What every fetch of this part reads at most; the subscriber's parts and filters
        # join it per fetch (a subscriber read again may filter differently). A row over
        # twice the largest record (message.max.bytes) cannot fit in one, whatever the
        # format (JSON text as Postgres writes it is at most about twice as long as the
        # compact JSON published): it is poison, and never read.
        self._limits = Selection(
            batch_size, batch_max_bytes, part.part, max_row_bytes=2 * max_record_bytes
        )
        self._poll_interval = poll_interval
        self._store: PartStore | None = None
        # The publisher lent by the pool for this turn.
        self._publisher: Publisher | None = None
        self._space: KeySpace | None = None
        self._space_checked = False
        self._state: PartState | None = None  # None: load it on the next step
        self._ahead: _Batch | None = None  # the next batch, prepared while the last travelled
        self._repolls: Iterator[float] = iter(())
        self._waited = False  # the last step found nothing and waited
        self._caught_up = False  # the last fetch found nothing new (idle polls keep it)
        self._failures = 0
        # The service waited for and how it failed (waiting_on), and the attempts failed.
        self._outage: tuple[str, type[Exception]] | None = None
        self._outage_failures = 0
        # What it waits for, as its checkpoint row says it for `status` (issue #48).
        self._wait_record = WaitRecord(part, session.id)
        # Poison warnings, sampled: a flood of poison rows logs a few, then a summary.
        self._poison_log = SampledLog(
            logger,
            f"part {part}: %d more poison events in the last %.0f s were not logged one by "
            "one (`outbox-relay dead-letters list` shows the dead letters)",
            self._sampled_out,
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
                    self._waited_out()
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

    def _warn_poison(self) -> bool:
        """Whether a poison event's warning is logged: sampled, a flood logs a few, then
        a summary; one left out is counted."""
        if self._poison_log.allows():
            return True
        with self.stats.lock:
            self.stats.poison_warnings_sampled_out += 1
        return False

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
        # An outage logs once per part: the retries that follow for the same service,
        # failing the same way, are counted (outbox_relay_errors, and the line when it
        # is waited for no longer). Another kind of failure is logged: it may need someone.
        waits_on = exc.waits_on if isinstance(exc, RelayError) else None
        outage = None if waits_on is None else (waits_on, type(exc))
        again = outage is not None and outage == self._outage and self.stats.waiting_on is not None
        self._outage = outage
        self._outage_failures = self._outage_failures + 1 if again else 1
        self._record_error(WorkerState.RETRYING, exc)
        logger.log(
            logging.ERROR if unexpected else logging.DEBUG if again else logging.WARNING,
            "part %s: %s%s; retrying in %.1fs",
            self.part,
            f"unexpected {type(exc).__name__}: " if unexpected else "",
            exc,
            delay,
            exc_info=exc if unexpected else None,
            extra=self._log_extra("part_retrying", retry_in=delay, error=exc),
        )
        if waits_on is not None:
            self._wait_record.waiting(self._held_store, waits_on, str(exc))
        # Start over from recovery: the transaction's fate may be unknown.
        self._drop_connections()
        return delay

    def _waited_out(self) -> None:
        """A turn went through after retries for an unreachable service: say so once,
        with how many retries the outage cost (logged at DEBUG after the first)."""
        service, self.stats.waiting_on = self.stats.waiting_on, None
        if self.stats.state is WorkerState.RETRYING:
            self.stats.state = WorkerState.RUNNING
        logger.info(
            "part %s: no longer waiting for %s, after %d attempts that failed",
            self.part,
            service,
            self._outage_failures,
            extra=self._log_extra("part_waited", service=service, failed=self._outage_failures),
        )

    # -- the loop ----------------------------------------------------------------------

    def _serve(self, woken: bool) -> float:
        """Publish until the part is caught up, stopping, or its turn is up while
        other parts wait; returns the seconds until its next turn. Raises on errors."""
        store = self._held_store()
        if not self._space_checked:  # (re)started: before anything else on this part
            self._space = self._check_key_space(store)
            self._space_checked = True
            # Recover at once, as a part is taken over: earlier owners are fenced now,
            # not when the first row comes, and a producer Kafka refuses shows at once.
            self._state = self._lend_publisher(store, self._load(store))
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
            # Between turns the pool may close it; holding it would keep its client alive.
            self._publisher = None
            self._producers.release(self)

    def _step(self, store: PartStore, woken: bool, *, read_ahead: bool) -> float | None:
        """Publish one batch (None: go on), or say how long to wait for the next;
        ``read_ahead``: read the batch after it while it travels."""
        if self._state is None or (self._waited and not woken):
            self._state = self._reload(store, self._state)  # an idle tick's: pause or reset
        self._waited = False
        state = self._state
        if state.subscriber.paused or state.halted_error is not None:
            self.stats.state = WorkerState.HALTED if state.halted_error else WorkerState.PAUSED
            self._state, self._ahead = None, None
            return self._poll_interval
        if self.stats.waiting_on is None:  # a waiting part stays 'retrying' until it is not
            self.stats.state = WorkerState.RUNNING
        ahead, self._ahead = self._ahead, None
        batch = ahead if ahead is not None and ahead.end else self._fetch(store, state)
        if batch.end is None:
            self._poison_log.flush()  # caught up: a flood is over, say what was left out
            if woken:
                self._repolls = iter(_HORIZON_REPOLL_S)
            self._waited = True
            was_caught_up, self._caught_up = self._caught_up, True
            if not was_caught_up and self._on_wait is not None:
                self._on_wait()  # after the flag: the probe checks it once told
            return next(self._repolls, self._poll_interval)
        self._caught_up = False
        if not batch.events:
            # Only rows the subscriber does not take: the Postgres checkpoint alone moves,
            # and no producer is needed (what Kafka holds of the part stays as it is).
            self._state = self._advance(store, state, batch.end, [])
            self._count([], 0, batch.end)
            return None
        recovered = self._lend_publisher(store, state)
        if recovered is not None:
            if not _same_batch_start(recovered, state):
                self._state = None  # recovery moved the checkpoint (or a pause): read again
                return None
            state = recovered
        # None: halted on a poison event
        self._state = self._publish(store, state, batch, read_ahead)
        if self._state is None:
            self._ahead = None
        else:
            self._failures = 0
        return None

    def _lend_publisher(self, store: PartStore, state: PartState) -> PartState | None:
        """Borrow this part's publisher from the pool for this turn. One opened for it
        just now is recovered with first (fencing the part's earlier producers): then
        the part's state after recovery."""
        self._publisher, fresh = self._producers.acquire(self, state)
        if not fresh:
            return None
        with self.stats.lock:
            self.stats.producers_opened += 1
        # Ownership is read from Postgres right before init_transactions fences: a part
        # this relay no longer owns never gets a new producer (docs/design.md).
        current = self._load(store)
        if not self.session.valid():
            raise ClaimLost("this relay's session may have expired; not recovering")
        return self._recover(store, current, self._space)

    def _fetch(self, store: PartStore, state: PartState) -> _Batch:
        subscriber = state.subscriber
        # Rows the subscriber drops stay in Postgres (all but the last read, which
        # carries the checkpoint past them); matches() below still decides.
        selection = dataclasses.replace(
            self._limits,
            parts=subscriber.parts,
            aggregate_types=subscriber.aggregate_types,
            event_types=subscriber.event_types,
        )
        events, read_to, full = store.fetch(state.checkpoint, selection)
        if state.skips:  # rare: a set lookup per event only while the operator skips some
            events = self._without_skips(events, state.skips)
        return _Batch(events, read_to, full)

    def _without_skips(
        self, events: list[OutboxEvent], skips: frozenset[UUID]
    ) -> list[OutboxEvent]:
        """``events`` but those the operator skipped (`subscribers skip`): the batch's
        end still passes them, so its checkpoint does, in the batch's own commit."""
        kept = [e for e in events if e.message_id not in skips]
        for event in events:
            if event.message_id in skips:
                logger.info(
                    "part %s: event %s at %s skipped by the operator, not published",
                    self.part,
                    event.message_id,
                    event.key,
                    extra=self._log_extra("event_skipped", message_id=event.message_id),
                )
        return kept

    def _prepare(self, store: PartStore, state: PartState, read: _Batch | None = None) -> _Batch:
        """Fetch (or take ``read``: what a cut left) and encode the batch after
        ``state``'s checkpoint. A poison event is left to the slow path (a halt needs the
        store, which the batch in flight is using), but on a dead-letter subscriber: its
        dead letters are decided here, so a flood of them is encoded while the last
        batch commits, as a backlog of good events is."""
        batch = (
            self._fetch(store, state) if read is None else _Batch(read.events, read.end, read.full)
        )
        subscriber = state.subscriber
        encode = self._encoder.for_subscriber(subscriber)
        try:
            if not subscriber.filtered:  # the usual subscriber: one C-level loop
                batch.records = list(map(encode, batch.events))
            else:
                batch.records = [
                    encode(event)
                    for event in batch.events
                    if subscriber.matches(event) or _not_read(event)
                ]
        except Exception:  # whatever it is, the slow path names the event and its error
            batch.records = None
            if subscriber.on_poison is PoisonPolicy.DEAD_LETTER and batch.end is not None:
                self._decide_ahead(store, state, batch)
        return batch

    def _decide_ahead(self, store: PartStore, state: PartState, batch: _Batch) -> None:
        """Encode ``batch`` of a dead-letter subscriber with its poison events' dead
        letters, cut where one transaction's dead letters end; what only the slow path
        may do (halt on the relay's configuration, wait for a registry) is left to it."""
        assert batch.end is not None
        try:
            dead = store.dead_letters(state.name, state.checkpoint, batch.end)
            encoded = self._encode(store, state, batch.events, dead, ahead=True)
        except RelayError:  # the relay's configuration, a registry down...
            return  # the slow path meets it again
        if encoded is None:
            return
        batch.records, used = encoded
        batch.decided = dead
        if used < len(batch.events):
            batch.cut(used)

    def _check_key_space(self, store: PartStore) -> KeySpace | None:
        """Before anything is published on this connection: are the stored keys this
        cluster's? (A restore elsewhere may have moved the database under us.)"""
        check = store.check_key_space()
        if check is None:
            return None  # schema before migration 0004
        if check.action is not KeySpaceAction.UNCHANGED:
            report(check, f"part {self.part}")
            with self.stats.lock:
                if check.action is KeySpaceAction.REBASED:
                    self.stats.key_space_rebased += 1
                else:
                    self.stats.key_space_continued += 1
        return store.key_space()

    def _recover(self, store: PartStore, state: PartState, space: KeySpace | None) -> PartState:
        """Fence earlier producers of this part and adopt a newer Kafka-side checkpoint,
        if it provably belongs to this database's history."""
        assert self._publisher is not None
        recovered = self._publisher.recover(
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
        return self._advance(store, state, adopted, letters)

    def _publish(
        self, store: PartStore, state: PartState, batch: _Batch, look_ahead: bool
    ) -> PartState | None:
        """Publish ``batch``; returns the new state, the next batch (prepared meanwhile
        if ``look_ahead``) in ``_ahead`` (None: the part halted on a poison event, under
        the 'halt' policy). A batch the broker failed as a whole is published again one
        event per transaction."""
        pending = [batch]  # what is left to publish, the next at the end
        published: PartState | None = state
        while pending and published is not None:
            outcome = self._publish_batch(store, published, pending.pop(), look_ahead)
            if isinstance(outcome, list):
                # The broker failed several records together: one event per transaction
                # finds the culprit without blaming its neighbours.
                pending += [_Batch([event], event.key) for event in reversed(outcome)]
                look_ahead = False
                continue
            published = outcome
        return published

    def _publish_batch(
        self, store: PartStore, state: PartState, batch: _Batch, look_ahead: bool
    ) -> PartState | list[OutboxEvent] | None:
        """Publish ``batch`` in one transaction, after the poison policy dealt with what
        the broker refused; returns the new state (the batch read meanwhile in
        ``_ahead``), or the events to publish one by one (the broker failed them
        together), or None when the part halted."""
        if not self.session.valid():
            raise ClaimLost("this relay's session may have expired; not publishing")
        sending, dead = self._decided(store, state, batch)
        while True:
            if sending.records is None:
                encoded = self._encode(store, state, sending.events, dead)
                if encoded is None:
                    return None
                sending.records, used = encoded
                if used < len(sending.events):
                    sending.cut(used)
            reader = None
            if look_ahead:  # what a cut left is encoded meanwhile, as a batch read
                prepare = functools.partial(self._prepare, store, read=sending.rest)
                reader = _ReadAhead(prepare, state, sending, self.hook.joining)
            sent = self._send(state, sending, reader, _named(sending.events, dead))
            if sent.refused is None:
                return self._record(store, state, sent, dead, sending.rest)
            if sent.refused.ambiguous and len(sent.events) > 1:
                return sent.events
            if not self._blame(store, state, sent, sent.refused, dead):
                return None
            # Encoded again with the decision; what joined the batch stays in it. (What
            # a cut left is read again after it: a broker's refusal is rare.)
            assert sent.end is not None
            sending, look_ahead = _Batch(sent.events, sent.end, sent.full), False

    def _decided(
        self, store: PartStore, state: PartState, batch: _Batch
    ) -> tuple[_Batch, dict[UUID, DeadLetterDecision]]:
        """``batch`` as it goes out, its records kept if they still hold, and the
        dead-letter decisions that apply to it: made ahead with its records, or
        recorded before for its range (a reset moved the checkpoint back)."""
        assert batch.end is not None
        dead: dict[UUID, DeadLetterDecision] = {}
        if batch.decided is not None:
            dead = batch.decided
        elif state.subscriber.on_poison is PoisonPolicy.DEAD_LETTER:
            dead = store.dead_letters(state.name, state.checkpoint, batch.end)
        sending = _Batch(list(batch.events), batch.end, batch.full, rest=batch.rest)
        if batch.decided is not None or not dead:
            sending.records = batch.records
        return sending, dead

    def _send(
        self,
        state: PartState,
        batch: _Batch,
        reader: _ReadAhead | None,
        letters: list[tuple[Position, str]],
    ) -> _Batch:
        """One attempt at publishing ``batch``: the batch as sent, grown by what joined
        it meanwhile, if anything, and with ``refused`` set if the broker refused it."""
        assert self._publisher is not None and batch.records is not None
        assert batch.end is not None
        batch.records = self.hook.sending(batch.records)
        may_extend = reader is None or reader.may_join
        sending = Batch(batch.records, batch.end, str(state.generation), may_extend, letters)
        refused = None
        try:
            self._publisher.publish(sending, reader, self.session.valid)
        except PoisonRecordError as exc:
            if exc.wait is not None and state.subscriber.on_poison is PoisonPolicy.HALT:
                # It heals (a topic to be created, #48): waiting is never worse than
                # halting. Only 'dead-letter' takes the row, lest it hold back the rest.
                raise exc.wait from None
            refused = exc
        sent = reader.grown(batch) if reader is not None else batch
        sent.refused = refused
        return sent

    def _record(
        self,
        store: PartStore,
        state: PartState,
        sent: _Batch,
        dead: dict[UUID, DeadLetterDecision],
        rest: _Batch | None = None,
    ) -> PartState:
        """Checkpoint and count a committed batch, recording its dead-letter decisions
        with the checkpoint (never before: the transaction might have been aborted);
        returns the state, the next batch in ``_ahead``: the one read meanwhile, else
        ``rest``, what a cut left of the batch."""
        assert sent.records is not None and sent.end is not None
        self.hook.published(sent.events, sent.records, state.subscriber)  # visible now
        letters = _letters(sent.events, dead)
        advanced = self._advance(store, state, sent.end, letters)
        self._count(sent.records, len(letters), sent.end)
        self._poison_log.tick()  # a summary of the poison warnings left out, when due
        # A reset meanwhile moves the checkpoint elsewhere, and a skip changes what is
        # dropped (it bumps the version, so the advance reloaded the part): what was read
        # ahead is void.
        same = advanced.checkpoint == sent.end and advanced.skips == state.skips
        following = sent.ahead if sent.ahead is not None else rest
        self._ahead = following if same else None
        return advanced

    def _blame(
        self,
        store: PartStore,
        state: PartState,
        sent: _Batch,
        refused: PoisonRecordError,
        dead: dict[UUID, DeadLetterDecision],
    ) -> bool:
        """Apply the poison policy to the event of ``sent`` whose record the broker
        refused; False when the part halted."""
        event = _event_of(refused.record, sent.events)
        decision = dead.get(event.message_id)
        if decision is None:
            return self._poison(store, state, event, str(refused), dead, sent.events)
        # The dead letter itself was rejected: once more with the event's identity only
        # (a topic with a lower max.message.bytes), then the part halts: that is no
        # longer the row's doing but the dead-letter topic's.
        if decision.minimal:
            why = f"dead-letter record rejected: {refused.reason}"
            self._halt(store, state, event, why, sent.events)
            return False
        if self._warn_poison():
            logger.warning(
                "part %s: the dead letter of %s was rejected (%s); sending its identity only",
                self.part,
                event.message_id,
                refused.reason,
                extra=self._log_extra("dead_letter_minimal", message_id=event.message_id),
            )
        dead[event.message_id] = dataclasses.replace(decision, minimal=True)
        return True

    def _advance(
        self, store: PartStore, state: PartState, end: Position, letters: list[DeadLetter]
    ) -> PartState:
        """Record a committed batch, even if the version moved (a pause, say) meanwhile."""
        for _ in range(_ADVANCE_ATTEMPTS):
            try:
                # Durable only with dead letters. A crash of Postgres that loses a
                # checkpoint leaves an earlier one of this generation: transactional
                # delivery's recovery adopts Kafka's; idempotent delivery publishes again
                # from it, as at-least-once allows (docs/design.md §5). Dead letters are
                # not rebuilt past the last Kafka transaction, and a durable commit makes
                # every earlier one durable (the WAL is written in order).
                version = store.advance(state, end, self.session.id, letters, durable=bool(letters))
                return dataclasses.replace(state, checkpoint=end, version=version)
            except CheckpointConflict as exc:
                current = self._load(store)  # raises ClaimLost if a peer owns it now
                if current.generation != state.generation:
                    logger.info(
                        "part %s: checkpoint reset, reloading",
                        self.part,
                        extra=self._log_extra("part_checkpoint_moved"),
                    )
                    return current
                if current.checkpoint != state.checkpoint:
                    # Moved in the same generation: a restored database, a key-space
                    # rebase or a crash that lost asynchronous advances, not an
                    # operator. Going on from it would publish again what this batch
                    # committed; recovery adopts the batch's Kafka-side checkpoint
                    # instead, with its checks (docs/design.md §6).
                    raise CheckpointConflict(
                        f"part {self.part}: checkpoint moved to {current.checkpoint} "
                        f"in the same generation"
                    ) from exc
                state = current  # only the version moved: the batch is still the right one
        # Still racing after several tries: start over from recovery, which adopts the
        # Kafka-side checkpoint of the batch just committed instead of republishing it.
        raise CheckpointConflict(f"part {self.part}: could not record the batch ending at {end}")

    def _encode(
        self,
        store: PartStore,
        state: PartState,
        events: list[OutboxEvent],
        dead: dict[UUID, DeadLetterDecision],
        *,
        ahead: bool = False,
    ) -> tuple[list[KafkaRecord], int] | None:
        """The batch's records, poison events dead-lettered, and how many of ``events``
        they cover (all, unless its dead letters are more than the Kafka-side checkpoint
        can name, or than batch_max_bytes holds: then up to the first too many); None
        when the part halted. ``ahead``: while another batch travels, where the relay's
        configuration raises rather than halt the part."""
        subscriber = state.subscriber
        encode = self._encoder.for_subscriber(subscriber)
        if not dead and _in_one_loop(subscriber):
            every = _encode_every(encode, events)
            if every is not None:
                return every, len(events)
        records: list[KafkaRecord] = []
        cut = _Cut(self._limits.max_bytes)
        for at, event in enumerate(events):
            if not subscriber.matches(event) and not _not_read(event):
                continue
            if event.message_id not in dead:
                encoded = self._encode_one(store, state, encode, event, dead, ahead, events)
                if encoded is None:
                    return None  # halted
                if isinstance(encoded, KafkaRecord):
                    records.append(encoded)
                    continue
            decision = dead[event.message_id]
            letter = dead_letter_record(event, subscriber, decision)
            if not cut.admits(event.key, decision.topic, letter, at, len(records)):
                break
            records.append(letter)
        else:
            at = len(events)
        return cut.cut(records, at)

    def _encode_one(
        self,
        store: PartStore,
        state: PartState,
        encode: Callable[[OutboxEvent], KafkaRecord],
        event: OutboxEvent,
        dead: dict[UUID, DeadLetterDecision],
        ahead: bool,
        batch: list[OutboxEvent],
    ) -> KafkaRecord | DeadLetterDecision | None:
        """``event``'s record; or its dead-letter decision, now in ``dead``; or None
        when the part halted (the 'halt' policy, or the relay's own configuration)."""
        try:
            return encode(event)
        except EncodingError as exc:
            error = str(exc)
        except ConfigError as exc:  # the relay's own configuration: never poison
            if ahead:
                raise
            self._halt_config(store, state, exc)
            return None
        except RetryableError:
            raise  # the registry is down, say: the batch waits and is retried
        except Exception as exc:  # a row the encoder did not foresee: still its poison
            if self._warn_poison():
                logger.warning(
                    "part %s: encoding event %s raised %s",
                    self.part,
                    event.message_id,
                    type(exc).__name__,
                    exc_info=exc,
                    extra=self._log_extra("encoding_raised", message_id=event.message_id),
                )
            error = f"{type(exc).__name__}: {exc}"
        if not self._poison(store, state, event, error, dead, batch):
            return None
        return dead[event.message_id]

    def _poison(
        self,
        store: PartStore,
        state: PartState,
        event: OutboxEvent,
        error: str,
        dead: dict[UUID, DeadLetterDecision],
        batch: list[OutboxEvent],
    ) -> bool:
        """Apply the subscriber's policy to ``event`` of ``batch``: True when the event is
        dead-lettered, False when the part halted."""
        with self.stats.lock:
            self.stats.poisoned += 1
        error = cap(error, MAX_DEAD_LETTER_ERROR_BYTES)  # it may quote the row
        if state.subscriber.on_poison is PoisonPolicy.HALT:
            self._halt(store, state, event, error, batch)
            return False
        # Recorded in Postgres with the checkpoint that passes the event (_record).
        decision = DeadLetterDecision(state.subscriber.dead_letter_topic_name, error)
        if self._warn_poison():
            short = cap(error, MAX_STORED_ERROR_BYTES)  # the record keeps it all
            logger.warning(
                "part %s: poison event %s (%s:%s) goes to %s: %s",
                self.part,
                event.message_id,
                event.transaction_id,
                event.position,
                decision.topic,
                short,
                extra=self._log_extra(
                    "poison_dead_lettered", message_id=event.message_id, error=short
                ),
            )
        dead[event.message_id] = decision
        return True

    def _halt_config(self, store: PartStore, state: PartState, exc: ConfigError) -> None:
        """Stop the part, whatever its poison policy, until the configuration is fixed
        and the subscriber resumed: no event is dead-lettered for the relay's fault."""
        message = f"configuration error: {exc}"
        store.halt(state, self.session.id, message)
        self._record_error(WorkerState.HALTED, exc)
        logger.error(
            "part %s halted: %s",
            self.part,
            message,
            extra=self._log_extra("part_halted_config", error=message),
        )

    def _halt(
        self,
        store: PartStore,
        state: PartState,
        event: OutboxEvent,
        error: str,
        batch: list[OutboxEvent],
    ) -> None:
        """Halt the part on the poison ``event`` of ``batch`` (a batch starts just after
        the checkpoint), saying how to skip it alone, and what a reset past it would
        skip: the events of the batch up to it (issue #48)."""
        error = cap(error, MAX_DEAD_LETTER_ERROR_BYTES)
        subscriber = state.subscriber
        upto = [e for e in batch if e.key <= event.key and (subscriber.matches(e) or _not_read(e))]
        n = max(len(upto), 1)
        message = (
            f"poison event {event.message_id} at {event.key}: {error}. To skip this event "
            f"alone (every other event is published): `outbox-relay subscribers skip "
            f"{subscriber.name} --event {event.message_id}`; a reset to {event.key} would "
            f"skip {n} event(s) of this part, {n - 1} of them before this one"
        )
        store.halt(state, self.session.id, message, event.message_id)
        self._record_error(WorkerState.HALTED, RelayError(message))
        logger.error(
            "part %s halted (policy 'halt'; `outbox-relay subscribers resume %s` retries it): %s",
            self.part,
            self.part.subscriber,
            message,
            extra=self._log_extra("part_halted_poison", message_id=event.message_id, error=error),
        )

    # -- helpers -----------------------------------------------------------------------

    def _load(self, store: PartStore) -> PartState:
        state = store.get_part(*self.part)
        if state.owner != self.session.id:
            raise ClaimLost(f"part {self.part} is not claimed by this relay")
        self.stats.checkpoint = state.checkpoint
        return state

    def _reload(self, store: PartStore, known: PartState | None) -> PartState:
        """The part as stored now, ``known`` the state this worker last had of it.

        A checkpoint behind ``known``'s in the same generation was lost by Postgres (an
        asynchronous commit before a crash, docs/design.md §5) or restored (§6); going
        on from it would publish again what Kafka holds. The part starts over from
        recovery, which adopts Kafka's checkpoint."""
        state = self._load(store)
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

    def _count(self, records: list[KafkaRecord], dead_lettered: int, end: Position) -> None:
        published = len(records)
        sizes = list(map(_SIZE, records))  # as the encoder counted them: no call each
        size = sum(sizes) if min(sizes, default=0) >= 0 else sum(r.byte_size() for r in records)
        with self.stats.lock:
            self.stats.published += published
            self.stats.published_bytes += size
            self.stats.dead_lettered += dead_lettered
            self.stats.batches += 1
            self.stats.checkpoint = end
            if published:
                self.stats.last_published_at = time.time()

    def _held_store(self) -> PartStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def _drop_connections(self) -> None:
        """Forget everything read: the next turn starts over from recovery."""
        store, self._store = self._store, None
        self._publisher, self._state, self._ahead = None, None, None
        self._space_checked, self._waited = False, False
        try:
            if store is not None:
                store.close()
        finally:
            self._producers.discard(self)

    def _record_error(self, state: WorkerState, exc: Exception) -> None:
        with self.stats.lock:
            self.stats.errors += 1
            self.stats.last_error = str(exc)
            self.stats.state = state
            waits_on = exc.waits_on if isinstance(exc, RelayError) else None
            self.stats.waiting_on = waits_on if state is WorkerState.RETRYING else None


class _Cut:
    """Where a batch with dead letters is cut: before the first dead letter the
    Kafka-side checkpoint cannot name (docs/design.md §7), or that would take them past
    ``max_bytes`` (a dead letter outweighs a small row); never before the first. Told of
    each dead letter as it is made, so a cut batch encodes little past the cut."""

    # How often the tag is measured (it is deflated: no sum of sizes tells its size);
    # past the cut, at most this many dead letters are made for nothing.
    _EVERY = 256

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes, self._bytes = max_bytes, 0
        self._named = dead_letter_tag.Named()
        self._letters: list[tuple[Position, str]] = []
        self._at: list[tuple[int, int]] = []  # each dead letter's event and record

    def admits(
        self, key: Position, topic: str, letter: KafkaRecord, event: int, record: int
    ) -> bool:
        """Whether the dead letter of the event at ``event`` (its record at ``record``)
        joins the batch; False: the batch ends before that event."""
        self._bytes += letter.byte_size()
        if self._at and self._bytes > self._max_bytes:
            return False
        self._named.add(key, topic)
        self._letters.append((key, topic))
        self._at.append((event, record))
        return bool(len(self._at) % self._EVERY) or self._fits()

    def cut(self, records: list[KafkaRecord], end: int) -> tuple[list[KafkaRecord], int]:
        """The records of the batch and how many of its events they cover, given the
        ``records`` made and the ``end`` of the events they cover."""
        if self._fits():
            return records, end
        fit = dead_letter_tag.fitting(self._letters)  # at least 1: one always fits
        event, record = self._at[fit]
        return records[:record], event

    def _fits(self) -> bool:
        return self._named.size() <= dead_letter_tag.MAX_TAG_BYTES


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


def _joins(following: _Batch, state: PartState) -> bool:
    """Whether a batch read ahead joins the transaction in flight: only when the relay
    is caught up (a backlog is better served by full batches, each overlapping the
    last one's commit), every event encoded cleanly, and no dead-letter decision (made
    on the slow path) could apply."""
    return (
        following.records is not None
        and following.end is not None
        and not following.full
        and state.subscriber.on_poison is not PoisonPolicy.DEAD_LETTER
    )


def _in_one_loop(subscriber: Subscriber) -> bool:
    """Whether a batch of ``subscriber`` with no dead-letter decision may be encoded by
    :func:`_encode_every`: no filter to apply, and a format encoded locally (a registry's
    answer may differ from one call to the next, and registering twice is not free)."""
    return (
        subscriber.aggregate_types is None
        and subscriber.event_types is None
        and subscriber.value_format in LOCAL_FORMATS
    )


def _encode_every(
    encode: Callable[[OutboxEvent], KafkaRecord], events: list[OutboxEvent]
) -> list[KafkaRecord] | None:
    """Every event's record, in one C loop: the usual batch (no filter, no dead letter
    decided yet) needs no filter call and no dead-letter lookup per event (hashing a UUID
    is a Python call). None when an event raised: a local format's encoding is a
    function of the event (:func:`_in_one_loop`), so the worker's loop meets the same
    error on it and applies the poison policy."""
    try:
        return list(map(encode, events))
    except Exception:
        return None  # the loop meets it again: poison, the relay's config, or a retry


def _letters(events: list[OutboxEvent], dead: dict[UUID, DeadLetterDecision]) -> list[DeadLetter]:
    """The dead letters among ``events``, as Postgres records them: the error cut at
    MAX_STORED_ERROR_BYTES (the record on the dead-letter topic carries it whole)."""
    if not dead:
        return []
    return [
        DeadLetter(e.key, e.message_id, _stored(dead[e.message_id]))
        for e in events
        if e.message_id in dead
    ]


def _stored(decision: DeadLetterDecision) -> DeadLetterDecision:
    error = cap(decision.error, MAX_STORED_ERROR_BYTES)
    return decision if error is decision.error else dataclasses.replace(decision, error=error)


def _named(
    events: list[OutboxEvent], dead: dict[UUID, DeadLetterDecision]
) -> list[tuple[Position, str]]:
    """The dead letters among ``events`` as the Kafka-side checkpoint names them."""
    if not dead:
        return []
    return [(e.key, dead[e.message_id].topic) for e in events if e.message_id in dead]


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


def _not_read(event: OutboxEvent) -> bool:
    """A row the fetch left unread (too large): the fetch's own filters kept it, on its
    full columns; its text columns came back cut short, so they may not match here."""
    return type(event.payload) is Unreadable and not event.payload.read


def _event_of(record: KafkaRecord, events: list[OutboxEvent]) -> OutboxEvent:
    wanted = record.outbox_message_id
    for event in events:
        if str(event.message_id) == wanted:
            return event
    raise RelayError(f"the broker rejected a record the batch does not contain: {record.topic}")
