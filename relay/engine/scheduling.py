"""Bounded resources for many parts: a few threads take turns running the parts that
have work, and a few Kafka producers are lent to the parts that publish.

A relay may own hundreds of parts, most of them idle. A thread and a transactional
producer per part (with the producer's own client threads and sockets) made a relay of
100 parts idle at 900 threads. Here an idle part is only an entry in a timer queue:
:class:`PartScheduler` runs a part's turn on one of at most ``threads`` threads when it
is due (its poll timer) or woken (the commit probe), and :class:`ProducerPool` keeps at
most ``size`` publishers open, each bound to one part, the least recently used idle one
closed to make room. A part keeps its publisher while it stays busy and the pool has
room, so a few busy parts pay for ``init_transactions`` once, not per turn. Why zombie
fencing still holds: docs/design.md, "Bounded producers".
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from relay.core.log_fields import log_extra
from relay.core.ports import PartState, Publisher

logger = logging.getLogger(__name__)


class Turns(Protocol):
    """Something the scheduler runs in turns (a part worker)."""

    def turn(self, woken: bool) -> float | None:
        """Run one turn; ``woken``: woken since the last one began. Returns the seconds
        until the next turn is due (woken earlier by :meth:`PartScheduler.wake`), or
        None when it is done for good."""


class PartScheduler:
    """Runs turns of many tasks on at most ``threads`` threads, each when it is due.

    A task is either waiting (in the timer queue), running (on one thread: never on
    two at once), or done. A task woken while it runs has its next turn at once."""

    def __init__(self, threads: int, *, name: str = "part-runner") -> None:
        if threads < 1:
            raise ValueError("a scheduler needs at least one thread")
        self._size = threads
        self._name = name
        self._lock = threading.Condition()
        self._queue: list[tuple[float, int, Turns]] = []  # (due, tie-break, task)
        self._due: dict[Turns, float] = {}  # waiting tasks; heap entries not here are stale
        self._running: set[Turns] = set()
        self._woken: set[Turns] = set()
        self._threads: list[threading.Thread] = []
        self._idle_threads = 0
        self._closing = False
        self._order = itertools.count()

    # -- what tasks and their owners call ----------------------------------------------

    def submit(self, task: Turns, delay: float = 0.0) -> None:
        """Schedule ``task``'s first turn ``delay`` seconds from now."""
        with self._lock:
            self._closing = False
            self._threads = [t for t in self._threads if t.is_alive()]
            self._queue_at(task, time.monotonic() + delay)
            if self._idle_threads == 0 and len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._lock.notify()

    def wake(self, task: Turns) -> None:
        """Run ``task``'s next turn as soon as a thread is free."""
        with self._lock:
            if task in self._running:
                self._woken.add(task)
            elif task in self._due:
                self._woken.add(task)
                if self._due[task] > time.monotonic():
                    self._queue_at(task, time.monotonic())
                    self._lock.notify()

    def contended(self) -> bool:
        """Whether a task is due and waits for a thread (so a long turn should end)."""
        with self._lock:
            self._drop_stale()
            return bool(self._queue) and self._queue[0][0] <= time.monotonic()

    @property
    def threads(self) -> int:
        """The threads running now (started on demand, at most ``threads``)."""
        with self._lock:
            return sum(1 for t in self._threads if t.is_alive())

    def close(self) -> None:
        """Let the threads end once no turn is due (a later :meth:`submit` starts them
        again). Waiting tasks stay queued."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()

    # -- the threads -------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            with self._lock:
                woken = task in self._woken
                self._woken.discard(task)
            delay: float | None = None
            try:
                delay = task.turn(woken)
            except Exception:  # the task's own bug: it must not take the thread with it
                logger.exception(
                    "a scheduled turn failed; its task is dropped",
                    extra=log_extra("scheduled_turn_failed"),
                )
            with self._lock:
                self._running.discard(task)
                if delay is not None:
                    woken_meanwhile = task in self._woken
                    self._queue_at(task, time.monotonic() + (0.0 if woken_meanwhile else delay))
                    self._lock.notify()
                else:
                    self._woken.discard(task)

    def _next(self) -> Turns | None:
        """Wait for a due task and mark it running; None when closing and none is due."""
        with self._lock:
            while True:
                self._drop_stale()
                now = time.monotonic()
                if self._queue and self._queue[0][0] <= now:
                    _, _, task = heapq.heappop(self._queue)
                    del self._due[task]
                    self._running.add(task)
                    return task
                if self._closing:
                    return None
                timeout = self._queue[0][0] - now if self._queue else None
                self._idle_threads += 1
                try:
                    self._lock.wait(timeout)
                finally:
                    self._idle_threads -= 1

    def _queue_at(self, task: Turns, due: float) -> None:
        self._due[task] = due
        heapq.heappush(self._queue, (due, next(self._order), task))

    def _drop_stale(self) -> None:
        while self._queue:
            due, _, task = self._queue[0]
            if self._due.get(task) == due:
                return
            heapq.heappop(self._queue)


class ProducerPool:
    """At most ``size`` publishers open at once, each lent to one part (its owner).

    :meth:`acquire` returns the owner's publisher if it is still open, or opens one,
    closing the least recently used publisher no one holds if the pool is full. The
    caller must run recovery on a publisher opened for it before it publishes: a new
    publisher's ``init_transactions`` is what fences the part's earlier producers. It
    keeps no reference to a publisher between its turns, so a closed one is freed (its
    client's threads end only when it is)."""

    def __init__(self, open_publisher: Callable[[PartState], Publisher], size: int) -> None:
        if size < 1:
            raise ValueError("a producer pool needs room for at least one producer")
        self._open = open_publisher
        self._size = size
        self._lock = threading.Condition()
        self._idle: OrderedDict[Hashable, Publisher] = OrderedDict()  # least recent first
        self._held: dict[Hashable, Publisher] = {}
        self._released_at: dict[Hashable, float] = {}
        self._opening = 0  # slots taken by publishers being opened

    @property
    def open(self) -> int:
        """Publishers open (or being opened) now."""
        with self._lock:
            return len(self._idle) + len(self._held) + self._opening

    def acquire(self, owner: Hashable, state: PartState) -> tuple[Publisher, bool]:
        """``owner``'s publisher, held by it until :meth:`release`, and whether it was
        opened just now (then it must recover before it publishes)."""
        victim: Publisher | None = None
        with self._lock:
            if owner in self._held:
                return self._held[owner], False
            kept = self._idle.pop(owner, None)
            self._released_at.pop(owner, None)
            if kept is not None:
                self._held[owner] = kept
                return kept, False
            while len(self._idle) + len(self._held) + self._opening >= self._size:
                if self._idle:
                    gone, victim = self._idle.popitem(last=False)
                    self._released_at.pop(gone, None)
                    break
                self._lock.wait()  # every publisher is held: wait for a release
            self._opening += 1
        try:
            if victim is not None:
                _close(victim)
            publisher = self._open(state)
        except BaseException:
            with self._lock:
                self._opening -= 1
                self._lock.notify()
            raise
        with self._lock:
            self._opening -= 1
            self._held[owner] = publisher
        return publisher, True

    def release(self, owner: Hashable) -> None:
        """``owner`` is done for now: its publisher stays open until room is needed."""
        with self._lock:
            publisher = self._held.pop(owner, None)
            if publisher is not None:
                self._idle[owner] = publisher
                self._released_at[owner] = time.monotonic()
                self._lock.notify()

    def discard(self, owner: Hashable) -> None:
        """Close ``owner``'s publisher (its part failed, stopped or moved)."""
        with self._lock:
            publisher = self._held.pop(owner, None) or self._idle.pop(owner, None)
            self._released_at.pop(owner, None)
            self._lock.notify()
        if publisher is not None:
            _close(publisher)

    def close_idle(self, older_than: float = 0.0) -> None:
        """Close every publisher no one has held for ``older_than`` seconds: a part
        idle that long holds no producer (it recovers when it has rows again)."""
        now = time.monotonic()
        with self._lock:
            stale = [
                owner
                for owner in self._idle
                if now - self._released_at.get(owner, now) >= older_than
            ]
            idle = [self._idle.pop(owner) for owner in stale]
            for owner in stale:
                self._released_at.pop(owner, None)
            self._lock.notify_all()
        for publisher in idle:
            _close(publisher)


def _close(publisher: Publisher) -> None:
    try:
        publisher.close()
    except Exception as exc:  # closing is best effort: the next init fences it anyway
        logger.warning(
            "closing a producer failed: %s",
            exc,
            extra=log_extra("producer_pool_close_failed", error=exc),
        )
