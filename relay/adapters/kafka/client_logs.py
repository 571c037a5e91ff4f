"""librdkafka's own log lines, through ``logging``, deduplicated and rate-limited.

A client that cannot reach its broker logs every reconnect attempt of every thread
(hundreds of lines a minute), each with its own counters and timings. The relay says
what matters once (relay/adapters/kafka/broker_watch.py); these lines stay for debugging, but each kind
at most once a minute, with a count of what was held back. Two kinds that are no fault
are lowered first: a coordinator's warm-up, and a setting meant for the other kind of
client.
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


class _Lowered(logging.Filter):
    """Lowers the client's lines that match ``pattern`` from above ``level`` to it; a line
    the logger would not log at that level is dropped."""

    pattern: re.Pattern[str]
    level: int

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > self.level and self.pattern.search(record.getMessage()):
            record.levelno, record.levelname = self.level, logging.getLevelName(self.level)
            return logging.getLogger(record.name).isEnabledFor(self.level)
        return True


class WarmUpFilter(_Lowered):
    """A broker's normal warm-up (issue #28): on a fresh cluster the transaction and group
    coordinators take seconds to load, and the client says so at WARNING while it
    retries. Retried by the client, that is no fault (a broker that stays away is
    reported by relay/adapters/kafka/broker_watch.py): INFO."""

    pattern = re.compile(
        r"coordinator load in progress|not coordinator|coordinator not available"
        r"|COORDINATOR_LOAD_IN_PROGRESS|NOT_COORDINATOR|COORDINATOR_NOT_AVAILABLE",
        re.IGNORECASE,
    )
    level = logging.INFO


class OtherClientsSettingFilter(_Lowered):
    """The operator's one ``kafka`` table goes to every client of the relay: its
    producers, and the consumers that read a part's checkpoint. librdkafka warns that a
    producer's setting (``compression.type``) is ignored by a consumer, and the reverse,
    at every client it opens, so every recovery said it: by design, so DEBUG."""

    pattern = re.compile(
        r"is a (producer|consumer) property and will be ignored by this (consumer|producer)"
    )
    level = logging.DEBUG


def client_logger() -> logging.Logger:
    """The logger every librdkafka client of the relay logs through."""
    found = logging.getLogger("relay.adapters.kafka.client")
    # Before RepeatFilter: a line held is not counted.
    for lowered in (WarmUpFilter, OtherClientsSettingFilter):
        if not any(isinstance(f, lowered) for f in found.filters):
            found.addFilter(lowered())
    if not any(isinstance(f, RepeatFilter) for f in found.filters):
        found.addFilter(RepeatFilter())
    return found
