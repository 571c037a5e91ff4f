"""Sampled warnings: the first few of a kind per interval one by one, the rest counted.

A warning per poison row let one INSERT of 20,000 poison rows write 20,000 warnings of
1.3 KB each (issue #47): the log, not the relay, took the flood. A part's poison
warnings now go through a :class:`SampledLog`: the first ``first`` of each interval
are logged as before, the rest are only counted, and one line says how many were left
out, once the interval is over (at the next warning or :meth:`SampledLog.tick`) or when
:meth:`SampledLog.flush` is called (the part caught up, or stopped). The events themselves are counted by their own
metrics whatever is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# Warnings logged one by one per interval, and the interval: a flood writes at most
# FIRST + 1 lines a minute per part.
FIRST = 10
INTERVAL_S = 60.0


class SampledLog:
    """Warnings of one kind from one source (a part's poison events), sampled: the
    caller logs a warning only if :meth:`allows` says so (so a warning left out costs
    no formatting). ``summary`` is the line that says how many were left out: a
    %-format taking that number and the seconds they came in, logged at ``level``
    (WARNING, unless the lines sampled are of a lower level)."""

    def __init__(
        self,
        logger: logging.Logger,
        summary: str,
        extra: Callable[[int], dict[str, object]],
        *,
        first: int = FIRST,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
    ) -> None:
        self._logger, self._summary, self._extra = logger, summary, extra
        self._level = level  # the summary's
        self._first, self._interval, self._clock = first, interval, clock
        self._started: float | None = None  # when the current interval began
        self._logged = 0  # in the current interval
        self._left_out = 0  # in the current interval, not yet summed up

    def allows(self) -> bool:
        """Whether the next warning may be logged one by one (the caller logs it);
        False: it is counted, for the summary."""
        now = self._clock()
        if self._started is None or now - self._started >= self._interval:
            self.flush()
            self._started, self._logged = now, 0
        if self._logged < self._first:
            self._logged += 1
            return True
        self._left_out += 1
        return False

    def tick(self) -> None:
        """Say how many were left out if the interval is over (called as work goes on,
        so a summary does not wait for the next warning)."""
        if self._started is not None and self._clock() - self._started >= self._interval:
            self.flush()
            self._started = None

    def flush(self) -> None:
        """Say how many warnings were left out since the last summary, if any."""
        left_out, self._left_out = self._left_out, 0
        if left_out:
            since = self._clock() - (self._started if self._started is not None else 0.0)
            self._logger.log(
                self._level, self._summary, left_out, since, extra=self._extra(left_out)
            )
