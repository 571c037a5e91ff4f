"""The commit→visible latency of published events: a histogram per part's worker, which
``/metrics`` serves as ``outbox_relay_commit_to_visible_seconds`` (relay/daemon/metrics.py).

"Commit" time: the row's ``occurred_at`` column, which defaults to ``now()`` -- the start
of the writer's transaction, as Postgres has no commit time without
``track_commit_timestamp`` (which the relay does not require). The latency is therefore
an upper bound: it includes the writer's transaction itself. A writer that sets
``occurred_at`` itself moves it; a value in the future counts as 0.

Recorded with tracing on or off (relay/observability/tracing.py's hook tells it of each
committed batch): one bucket increment per event.
"""

from __future__ import annotations

import bisect
import functools
import operator
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from itertools import repeat

from relay.core.model import PG_EPOCH, FetchedEvent, OutboxEvent, occurred_micros

# Seconds; Prometheus's own defaults stretched to 5 min, as a relay catching up on a
# backlog publishes events minutes old.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Keys of a part's statistics (relay/daemon/parts.py) that carry the histogram, which
# the /metrics collector turns back into one (relay/daemon/metrics.py).
LATENCY_KEY = "commit_to_visible"
_BUCKET_KEYS = (*(f"{LATENCY_KEY}_le_{b}" for b in LATENCY_BUCKETS), f"{LATENCY_KEY}_le_+Inf")
# The sum in whole microseconds: statistics are integer counters.
SUM_KEY, COUNT_KEY = f"{LATENCY_KEY}_sum_us", f"{LATENCY_KEY}_count"


class CommitLatency:
    """A cumulative histogram of commit→visible latencies (non-cumulative buckets; the
    collector adds them up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum_us = 0

    def observe(self, ages_us: Sequence[int]) -> None:
        """Count ``ages_us`` (:func:`ages_of`): C loops over integers, as this runs for
        every event published (a float per event cost twice as much as a timedelta, and a
        timedelta three times as much as an integer, #53)."""
        counted = Counter(map(_BUCKET_OF, ages_us))
        sum_us = sum(ages_us)
        with self._lock:
            for bucket, count in counted.items():
                self._buckets[bucket] += count
            self._sum_us += sum_us

    def counts(self) -> dict[str, int]:
        """The histogram as statistics keys (they add up across workers and processes)."""
        with self._lock:
            found = dict(zip(_BUCKET_KEYS, self._buckets, strict=True))
            found[SUM_KEY] = self._sum_us
            found[COUNT_KEY] = sum(self._buckets)
        return found


def ages_of(events: Sequence[OutboxEvent], now: datetime) -> list[int]:
    """Time from each event's commit (its ``occurred_at``) to ``now``, in whole
    microseconds; never negative (a writer's clock, or its ``occurred_at``, can be
    ahead). C loops, as :meth:`CommitLatency.observe`: a fetched batch's times are read
    as fetched, with no datetime per event."""
    if set(map(type, events)) == {FetchedEvent}:
        now_us = (now - PG_EPOCH) // _MICROSECOND
        ages = list(map(operator.sub, repeat(now_us), map(occurred_micros, events)))
    else:
        since = map(operator.sub, repeat(now), map(_OCCURRED_AT, events))
        ages = list(map(operator.floordiv, since, repeat(_MICROSECOND)))
    if ages and min(ages) < 0:
        return list(map(max, ages, repeat(0)))
    return ages


_MICROSECOND = timedelta(microseconds=1)
# Per event, in C: an age's bucket (its bound in microseconds: timedelta's resolution, so
# an age on a bound falls in the same bucket as before); an event's occurred_at.
_BUCKET_OF = functools.partial(bisect.bisect_left, tuple(round(b * 1e6) for b in LATENCY_BUCKETS))
_OCCURRED_AT = operator.attrgetter("occurred_at")
