"""One subscriber's publication loop: fetch → encode → publish → checkpoint.

Each subscriber runs in its own thread with its own Postgres connection and Kafka
producer, so a slow or halted subscriber never stalls the others.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from relay.encoding import RecordEncoder
from relay.errors import CheckpointConflict, RelayError, RetryableError, SubscriberError
from relay.kafka import Publisher
from relay.model import OutboxEvent, Position
from relay.store import OutboxStore, SubscriberState

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
# After a notification finds nothing decided yet (an older transaction still holds the
# horizon), re-poll soon rather than waiting out the whole poll interval.
_HORIZON_REPOLL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


class WorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    RETRYING = "retrying"
    HALTED = "halted"
    STOPPED = "stopped"


@dataclass
class WorkerStats:
    published: int = 0
    batches: int = 0
    errors: int = 0
    checkpoint: Position | None = None
    last_error: str | None = None
    last_published_at: float | None = None
    state: WorkerState = WorkerState.STARTING
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class SubscriberWorker(threading.Thread):
    def __init__(
        self,
        name: str,
        *,
        open_store: Callable[[], OutboxStore],
        open_publisher: Callable[[], Publisher],
        encoder: RecordEncoder,
        batch_size: int,
        poll_interval: float,
    ) -> None:
        super().__init__(name=f"subscriber-{name}", daemon=True)
        self.subscriber_name = name
        self.wakeup = threading.Event()
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._open_store = open_store
        self._open_publisher = open_publisher
        self._encoder = encoder
        self._batch_size = batch_size
        self._poll_interval = poll_interval
        self._store: OutboxStore | None = None
        self._publisher: Publisher | None = None

    def stop(self) -> None:
        self._stopping.set()
        self.wakeup.set()

    def run(self) -> None:
        failures = 0
        try:
            while not self._stopping.is_set():
                try:
                    self._serve()
                except RetryableError as exc:
                    failures += 1
                    delay = min(_MAX_BACKOFF_S, 0.1 * 2 ** min(failures, 10)) * random.uniform(
                        0.5, 1.0
                    )
                    self._record_error(WorkerState.RETRYING, exc)
                    logger.warning(
                        "subscriber %s: %s; retrying in %.1fs",
                        self.subscriber_name,
                        exc,
                        delay,
                        extra={"subscriber": self.subscriber_name, "retry_in": delay},
                    )
                    self._drop_store()
                    self._stopping.wait(delay)
                else:
                    failures = 0
        except RelayError as exc:
            if isinstance(exc, SubscriberError) and self._stopping.is_set():
                return  # removed while we ran (the finally block still cleans up)
            # Not retryable (a poison event, a permission error...): halt this subscriber
            # only, loudly, with its checkpoint left before the offending batch.
            self._record_error(WorkerState.HALTED, exc)
            logger.error(
                "subscriber %s halted: %s",
                self.subscriber_name,
                exc,
                extra={"subscriber": self.subscriber_name, "error": str(exc)},
            )
        finally:
            self._drop_store()
            if self._publisher is not None:
                self._publisher.close()
            if self.stats.state is not WorkerState.HALTED:
                self.stats.state = WorkerState.STOPPED

    def _serve(self) -> None:
        """Publish until stopped; raises on errors. Returns only when stopping."""
        store = self._connect()
        state = self._load(store)
        repolls: Iterator[float] = iter(())
        while not self._stopping.is_set():
            if state.subscriber.paused:
                self.stats.state = WorkerState.PAUSED
                self._stopping.wait(self._poll_interval)
                state = self._load(store)
                continue
            self.stats.state = WorkerState.RUNNING
            notified = self.wakeup.is_set()
            self.wakeup.clear()
            events = store.fetch(state.checkpoint, self._batch_size)
            if not events:
                if notified:
                    repolls = iter(_HORIZON_REPOLL_S)
                if not self.wakeup.wait(next(repolls, self._poll_interval)):
                    state = self._load(store)  # idle tick: notice pause/reset made elsewhere
                continue
            try:
                state = self._publish(store, state, events)
            except CheckpointConflict:
                logger.info(
                    "subscriber %s: checkpoint changed elsewhere, reloading", self.subscriber_name
                )
                state = self._load(store)

    def _publish(
        self, store: OutboxStore, state: SubscriberState, events: list[OutboxEvent]
    ) -> SubscriberState:
        subscriber = state.subscriber
        records = [self._encoder.encode(e, subscriber) for e in events if subscriber.matches(e)]
        end = events[-1].key
        if self._publisher is None:
            self._publisher = self._open_publisher()
        self._publisher.publish(records, end)
        try:
            version = store.advance(subscriber.name, end, state.version)
        except CheckpointConflict:
            # Only the version moved (a pause, say): the batch we published is still the
            # right one, so record it rather than publishing it again.
            current = self._load(store)
            if current.checkpoint != state.checkpoint:
                raise
            version = store.advance(subscriber.name, end, current.version)
            subscriber = current.subscriber
        with self.stats.lock:
            self.stats.published += len(records)
            self.stats.batches += 1
            self.stats.checkpoint = end
            if records:
                self.stats.last_published_at = time.time()
        return SubscriberState(subscriber, end, version, state.updated_at)

    def _load(self, store: OutboxStore) -> SubscriberState:
        try:
            state = store.get(self.subscriber_name)
        except SubscriberError:
            logger.info("subscriber %s was removed; stopping its worker", self.subscriber_name)
            self._stopping.set()
            raise
        self.stats.checkpoint = state.checkpoint
        return state

    def _connect(self) -> OutboxStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def _drop_store(self) -> None:
        if self._store is not None:
            try:
                self._store.conn.close()
            finally:
                self._store = None

    def _record_error(self, state: WorkerState, exc: Exception) -> None:
        with self.stats.lock:
            self.stats.errors += 1
            self.stats.last_error = str(exc)
            self.stats.state = state
