"""Find newly decided outbox rows quickly, without asking writers for anything.

Writers used to send ``NOTIFY`` from a trigger; PostgreSQL serialises every notifying
commit cluster-wide, which capped the application's write rate. Instead, one thread per
relay asks, every ``probe_interval``, for the newest row below the horizon: a backward
range scan of the primary key, ending at its first visible row. Rows become decided
only as the horizon passes them, and every row it passes sorts after every row it had
already passed (docs/design.md, "Ordering"), so that key changes exactly when
something new can be published. Then the workers are woken; they also poll on a timer.

After ``idle_after`` seconds without news the probe slows to ``idle_interval``: an idle
relay costs the database a few queries per second, not hundreds.

When the newest row changes, the probe reads the aggregate types of the rows decided
since its last look (at most ``_TYPES_SCANNED`` rows) and wakes only the parts that can
have rows of them: with hundreds of subscribers each filtered to its own type, one
type's commit wakes one subscriber's parts, not all of them (issue #30).

The probe looks only while some part it can wake waits for news (its last poll found
nothing new). A part draining a backlog polls again by itself, so a wake-up gains it
nothing: while every part is busy the probe sleeps until one starts waiting, then looks
at once; busy parts count as news for the idle slow-down (issue #31: the probe's queries
were about 1 µs of the relay's CPU per event in a drain).

A row's key can be the next xid, not yet handed out (docs/design.md, "Ordering"). On a
busy database the next transaction takes it; on an idle one the probe takes it itself
(one empty transaction), so such a row waits one probe interval, not for the next writer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import psycopg

from relay.adapters.postgres.queries import queries_for
from relay.core.log_fields import log_extra
from relay.errors import RelayError

logger = logging.getLogger(__name__)

# Rows whose types the probe reads per look at most: past it (a burst of writes) it
# wakes every part rather than read on.
_TYPES_SCANNED = 1000
_UNSEEN = object()
# The longest the probe sleeps while no part waits: it notices a stop only between sleeps
# (the parts' signal, not its own, ends them early).
_MAX_REST_S = 1.0
# After a part starts waiting, the probe's next _QUICK_LOOKS looks come _QUICK_FACTOR
# times as often as ``interval``: a part that just caught up with a steady stream
# usually has its next row within a few milliseconds, which a whole interval would make
# it wait for. Only so many looks, so a relay that keeps waiting costs no more than
# before.
_QUICK_LOOKS = 4
_QUICK_FACTOR = 5
# What a wake-up concerns: rows of these aggregate types (None: any).
Wake = Callable[[frozenset[str] | None], None]


class Waiters(Protocol):
    """The parts the probe wakes: whether one waits for news, and a way to sleep until
    one may start to (relay/daemon/parts.py)."""

    def waiting(self) -> bool:
        """Whether some part's last poll found nothing new."""

    def wait_for_waiting(self, timeout: float) -> None:
        """Return once a part may have started waiting, or after ``timeout`` seconds."""


class CommitProbe(threading.Thread):
    """Wakes the workers when the newest decided row changes."""

    def __init__(
        self,
        connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
        schema: str,
        wake: Wake,
        *,
        interval: float,
        idle_interval: float,
        idle_after: float = 10.0,
        waiters: Waiters | None = None,
    ) -> None:
        super().__init__(name="outbox-probe", daemon=True)
        # Borrowed per look (the relay's pool, relay/adapters/postgres/pool.py): not a backend of its own.
        self._connection = connection
        queries = queries_for(schema)
        self._query = queries["newest_decided"]
        self._types_query = queries["decided_types_between"]
        self._wake = wake
        self._interval = interval
        self._idle_interval = max(idle_interval, interval)
        self._idle_after = idle_after
        self._waiters = waiters  # None: look every interval, waiting parts or not
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            try:
                self._probe_until_stopped()
                delay = 0.5
            # psycopg's own errors while probing, and the relay's (db.connect wraps them)
            # while connecting: reconnect later; the workers' timer covers the gap.
            except (psycopg.Error, RelayError) as exc:
                logger.warning(
                    "commit probe: %s; reconnecting in %.1fs",
                    exc,
                    delay,
                    extra=log_extra("commit_probe_reconnecting", error=exc, retry_in=delay),
                )
                self._stopping.wait(delay)
                delay = min(delay * 2, 30.0)

    def _probe_until_stopped(self) -> None:
        last: object = _UNSEEN  # the first look wakes every part
        changed_at = time.monotonic()
        quick = 0  # looks left at the quick interval
        while not self._stopping.is_set():
            if not self._worth_a_look():
                # Parts drained rows until now (or none is claimed yet): a part that
                # catches up gets the quick looks, then the short interval, not the
                # idle one.
                changed_at = time.monotonic()
                quick = _QUICK_LOOKS
                continue
            woken: frozenset[str] | None = None
            with self._connection() as conn:
                conn.autocommit = True
                row = conn.execute(self._query, prepare=True).fetchone()
                assert row is not None
                # The newest key (None: no decided row); xid8 may come back as text.
                newest = None if row[0] is None else (int(row[0]), int(row[1]))
                waiting = row[2]
                if waiting:
                    # Rows keyed to the next xid, on a database where no transaction
                    # runs: take that xid (and commit at once) so the horizon passes them.
                    conn.execute("SELECT pg_catalog.pg_current_xact_id()")
                changed = newest != last
                if changed and isinstance(last, tuple) and newest is not None:
                    woken = self._types_between(conn, last, newest)
            now = time.monotonic()
            if changed:
                last, changed_at = newest, now
                self._wake(woken)
            self._stopping.wait(
                self._rest(idle=now - changed_at > self._idle_after, quick=quick > 0)
            )
            quick = max(0, quick - 1)

    def _rest(self, *, idle: bool, quick: bool) -> float:
        """How long to wait before the next look."""
        if idle:
            return self._idle_interval
        return self._interval / _QUICK_FACTOR if quick else self._interval

    def _worth_a_look(self) -> bool:
        """Whether a part waits for news; if none does, sleep until one may (or for
        the idle interval, at most a second, to notice a stop) and say no."""
        if self._waiters is None or self._waiters.waiting():
            return True
        self._waiters.wait_for_waiting(min(self._idle_interval, _MAX_REST_S))
        return False

    def _types_between(
        self, conn: psycopg.Connection[Any], after: tuple[int, int], upto: tuple[int, int]
    ) -> frozenset[str] | None:
        """The aggregate types of the rows in (after, upto]; None when there may be more
        than it read (or the newest row moved back: a restore)."""
        if upto < after:
            return None
        row = conn.execute(
            self._types_query,
            {
                "after_transaction_id": str(after[0]),
                "after_position": after[1],
                "upto_transaction_id": str(upto[0]),
                "upto_position": upto[1],
                "limit": _TYPES_SCANNED,
            },
            prepare=True,
        ).fetchone()
        assert row is not None
        types, scanned = row
        if scanned >= _TYPES_SCANNED or not types:
            return None
        return frozenset(types)
