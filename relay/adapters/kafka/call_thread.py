"""One thread that runs a producer's transactional calls, each waited for a bounded time.

librdkafka's calls that wait on the broker can block past their own timeout for good
(see ``TransactionalPublisher._watched``), so the caller waits for them on another
thread and gives up past a bound. A thread started per call cost about 0.25 ms a call on
a 2-core host (#31: three calls a transaction, at 1k ev/s a cycle of 8-10 ms); a
hand-off to a thread kept for the producer's life costs about a third of that.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Call(Generic[T]):
    """One call handed to the thread: its outcome once ``finished`` is set."""

    def __init__(self, operation: Callable[..., T], args: tuple[Any, ...]) -> None:
        self.operation = operation
        self.args = args
        self.finished = threading.Event()
        self.result: list[T] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.result.append(self.operation(*self.args))
        except BaseException as exc:  # handed to the caller, raised on its thread
            self.failure = exc
        finally:
            self.finished.set()


class CallThread:
    """Runs calls one at a time, in order, on one daemon thread started by the first.

    A call that outlives its caller's wait keeps the thread: the caller then gives up on
    the producer and this thread with it (a new producer gets a new one). :meth:`close`
    lets the thread end once the call in progress, if any, returns."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Call[Any] | None] | None = None

    def call(self, operation: Callable[..., T], args: tuple[Any, ...], wait_s: float) -> Call[T]:
        """Hand ``operation(*args)`` to the thread and wait up to ``wait_s`` for it; the
        call's ``finished`` is unset if it did not return in time."""
        call = Call(operation, args)
        self._queue().put(call)
        call.finished.wait(wait_s)
        return call

    def close(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, None
        if calls is not None:
            calls.put(None)  # the thread ends when it reaches this

    def _queue(self) -> queue.SimpleQueue[Call[Any] | None]:
        with self._lock:
            if self._calls is None:
                self._calls = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_serve, args=(self._calls,), name=self._name, daemon=True
                )
                thread.start()
            return self._calls


def _serve(calls: queue.SimpleQueue[Call[Any] | None]) -> None:
    while (call := calls.get()) is not None:
        call.run()
