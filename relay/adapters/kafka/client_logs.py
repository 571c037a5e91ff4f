"""librdkafka's own log lines, through ``logging``, deduplicated and rate-limited.

A client that cannot reach its broker logs every reconnect attempt of every thread
(hundreds of lines a minute), each with its own counters and timings. The relay says
what matters once (relay/adapters/kafka/broker_watch.py); these lines stay for debugging, but each kind
at most once a minute, with a count of what was held back.
"""

from __future__ import annotations

import logging
import re
import threading
import time

# What varies between repeats of one kind of line: numbers (ports, counts, durations,
# client instance ids).
_VARYING = re.compile(r"\d+")
_WINDOW_S = 60.0


class RepeatFilter(logging.Filter):
    """Lets a kind of line through once per window; the next one says how many were held."""

    def __init__(self, window_s: float = _WINDOW_S) -> None:
        super().__init__()
        self._window = window_s
        self._seen: dict[str, tuple[float, int]] = {}  # kind → (last let through, held back)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = f"{record.levelno}:{_VARYING.sub('#', record.getMessage())}"
        now = time.monotonic()
        with self._lock:
            last, held = self._seen.get(kind, (-self._window, 0))
            if now - last < self._window:
                self._seen[kind] = (last, held + 1)
                return False
            self._seen[kind] = (now, 0)
            if len(self._seen) > 10_000:  # bounded: forget the oldest kinds
                for stale in sorted(self._seen, key=lambda k: self._seen[k][0])[:5_000]:
                    del self._seen[stale]
        if held:
            record.msg = f"{record.getMessage()} ({held} similar lines held back)"
            record.args = None
        return True


# A broker's normal warm-up (issue #28): on a fresh cluster the transaction and group
# coordinators take seconds to load, and the client says so at WARNING while it retries.
_WARM_UP = re.compile(
    r"coordinator load in progress|not coordinator|coordinator not available"
    r"|COORDINATOR_LOAD_IN_PROGRESS|NOT_COORDINATOR|COORDINATOR_NOT_AVAILABLE",
    re.IGNORECASE,
)


class WarmUpFilter(logging.Filter):
    """Lowers the client's warnings about coordinators still loading to INFO: retried by
    the client, they are no fault (a broker that stays away is reported by
    relay/adapters/kafka/broker_watch.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and _WARM_UP.search(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def client_logger() -> logging.Logger:
    """The logger every librdkafka client of the relay logs through."""
    found = logging.getLogger("relay.adapters.kafka.client")
    if not any(isinstance(f, WarmUpFilter) for f in found.filters):
        found.addFilter(WarmUpFilter())  # before RepeatFilter: a line held is not counted
    if not any(isinstance(f, RepeatFilter) for f in found.filters):
        found.addFilter(RepeatFilter())
    return found
