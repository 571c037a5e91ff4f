"""librdkafka's own log lines, through ``logging``, deduplicated and rate-limited.

A client that cannot reach its broker logs every reconnect attempt of every thread
(hundreds of lines a minute), each with its own counters and timings. The relay says
what matters once (relay/broker_watch.py); these lines stay for debugging, but each kind
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


def client_logger() -> logging.Logger:
    """The logger every librdkafka client of the relay logs through."""
    found = logging.getLogger("relay.kafka.client")
    if not any(isinstance(f, RepeatFilter) for f in found.filters):
        found.addFilter(RepeatFilter())
    return found
