"""One thread for the transactional calls of a part's producers, each waited for a bounded time.

librdkafka's calls that wait on the broker can block past their own timeout for good
(see ``TransactionalPublisher._watched``), so the caller waits for them on another
thread and gives up past a bound. A thread started per call cost about 0.25 ms a call on
a 2-core host (#31: three calls a transaction, at 1k ev/s a cycle of 8-10 ms); a
hand-off to a thread kept for the producer's life costs about a third of that.

The caller may also start calls and wait for them later (:class:`Steps`): a commit then
travels while the caller reads the next batch, and a part's second producer is fenced
while its first is, with no other thread waiting on this one. A helper thread per part
holding a producer did that before, waiting the whole time on a call thread (#53).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

Step = tuple[Callable[..., object], tuple[Any, ...]]


class Steps:
    """Calls run one after another on a :class:`CallThread`, up to the first that raises:
    which one runs and since when, so that the caller can watch each for its own bound.
    """

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)
        # The step running (or that raised, or len(steps) once all returned), and when
        # it started: one tuple, so the caller reads both at once.
        self.at: tuple[int, float] = (0, time.monotonic())
        self.took: list[tuple[Callable[..., object], float]] = []
        self.finished = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            for index, (operation, args) in enumerate(self.steps):
                began = time.monotonic()
                self.at = (index, began)
                try:
                    operation(*args)
                finally:
                    self.took.append((operation, time.monotonic() - began))
            self.at = (len(self.steps), time.monotonic())
        except BaseException as exc:  # handed to the caller, raised on its thread
            self.failure = exc
        finally:
            self.finished.set()

    def wait(self, bound_s: float) -> Callable[..., object] | None:
        """Wait until every step returned or one raised; the operation of a step that ran
        past ``bound_s`` instead (it hung: the thread is lost to it)."""
        while True:
            index, began = self.at
            if self.finished.wait(max(0.0, began + bound_s - time.monotonic())):
                return None
            if self.at == (index, began):  # the same step the whole bound
                return self.steps[index][0]

    @property
    def failed_step(self) -> int:
        """The index of the step that raised (``failure``)."""
        return self.at[0]


class CallThread:
    """Runs calls one at a time, in order, on one daemon thread started by the first.

    A call that outlives its caller's wait keeps the thread: the caller then gives up on
    the producer and this thread with it (a new producer gets a new one). :meth:`close`
    lets the thread end once the call in progress, if any, returns; a call after it
    starts another (a part's two producers share one, and either may close it)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Steps | None] | None = None

    def start(self, steps: Sequence[Step]) -> Steps:
        """Hand ``steps`` to the thread, to run in order while the caller goes on."""
        started = Steps(steps)
        self._queue().put(started)
        return started

    def close(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, None
        if calls is not None:
            calls.put(None)  # the thread ends when it reaches this

    def _queue(self) -> queue.SimpleQueue[Steps | None]:
        with self._lock:
            if self._calls is None:
                self._calls = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_serve, args=(self._calls,), name=self._name, daemon=True
                )
                thread.start()
            return self._calls


def _serve(calls: queue.SimpleQueue[Steps | None]) -> None:
    while (steps := calls.get()) is not None:
        steps.run()
