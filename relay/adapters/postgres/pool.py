"""The relay process's Postgres connections: one bounded pool that every part, the
session keeper, the commit probe, upkeep and the HTTP endpoints borrow from.

A relay runs a thread per claimed part; with a connection each, a hundred subscribers
took a hundred backends and left applications none ("too many clients"). Here a
process holds at most ``max_db_connections`` backends, whatever it runs: each caller
borrows a connection for one store call (a query, or one explicit transaction) and
gives it back. Nothing the relay does spans two calls on one backend (the checkpoint
is a single compare-and-set statement, docs/design.md §5), so any backend will do.

Refusals are handled here too: a connection Postgres refuses (``too many clients``, a
standby during a failover, a wrong password, no answer) or one that would leave fewer
than ``keep_free_connections`` slots to everyone else is given up, logged once per
cause with that cause's remedy (relay/adapters/postgres/db.py tells them apart), and
retried with the pool's backoff.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from relay.adapters.postgres import db
from relay.adapters.postgres.store import OutboxStore
from relay.core.database_url import parse_url
from relay.core.log_fields import log_extra
from relay.core.redact import redact
from relay.errors import DatabaseUnavailable, RelayError

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# The relay's own refusal: a connection that would leave too few slots to applications.
_KEEP_FREE = db.Refusal(
    "keep_free_connections",
    "Raise max_connections, or lower max_db_connections x workers x replicas or "
    "keep_free_connections (deploy/README.md)",
)

# Free slots left to everyone else: Postgres' max_connections less the slots reserved for
# superusers less the client backends it runs. Counted from pg_stat_activity, whose rows
# of other roles (to a role without pg_read_all_stats) include a few background
# processes: an underestimate of what is free, so the relay errs on the side of leaving.
_FREE_SLOTS = b"""
SELECT pg_catalog.current_setting('max_connections')::int
     - pg_catalog.current_setting('superuser_reserved_connections')::int
     - pg_catalog.count(*) FILTER (WHERE backend_type IS NULL OR backend_type = 'client backend')
  FROM pg_catalog.pg_stat_activity
"""


class _Refusals:
    """Says once that Postgres refuses this relay a connection, again only when the
    cause changes (a failover: unreachable, then a standby), and once that it accepts
    them again (not at every retry of every connection)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cause: str | None = None
        self.last_failure: psycopg.OperationalError | None = None

    def refused(self, reason: str, why: db.Refusal) -> None:
        with self._lock:
            new, self._cause = self._cause != why.cause, why.cause
        if new:
            logger.warning(
                "Postgres refuses this relay a connection (%s); it keeps to the ones it "
                "has (at most max_db_connections) and retries with backoff. %s",
                reason,
                why.remedy,
                extra=log_extra("db_connection_refused", error=reason, cause=why.cause),
            )

    def accepted(self) -> None:
        with self._lock:
            was, self._cause = self._cause is not None, None
            self.last_failure = None
        if was:
            logger.info(
                "Postgres accepts this relay's connections again",
                extra=log_extra("db_connection_accepted"),
            )


# One per process, as the pool is: psycopg_pool makes connections through a class.
_REFUSALS = _Refusals()


class _RelayConnection(psycopg.Connection[TupleRow]):
    """A connection that reports Postgres' refusals (``too many clients``) to the log,
    once, instead of the pool's warning at every retry."""

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            return super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as exc:
            _REFUSALS.last_failure = exc
            _REFUSALS.refused(redact(str(exc)).strip(), db.refusal(exc))
            raise


class RelayPool:
    """At most ``max_size`` connections (autocommit) to the relay's database."""

    def __init__(
        self,
        url: str,
        *,
        max_size: int,
        keep_free: int,
        schema: str = "public",
        name: str = "outbox-relay",
        on_connect: Callable[[OutboxStore], None] | None = None,
        timeouts: db.SessionTimeouts | None = None,
    ) -> None:
        # For redacting errors; parsed once, not at every borrow (one per store call).
        self._secret = parse_url(url).get("password")
        self._timeouts = timeouts
        self._schema = schema
        # Run on every new connection, before it is used: the relay's key-space check.
        self._on_connect = on_connect
        self._keep_free = keep_free
        self._pool: ConnectionPool[_RelayConnection] = ConnectionPool(
            url,
            kwargs=db.connect_params(url, application_name=name),
            connection_class=_RelayConnection,
            min_size=1,
            max_size=max_size,
            # The pool's workers only open connections (it resets none on return): a
            # few, each in milliseconds, or an attempt that waits out connect_timeout
            # while Postgres is away, when more workers would wait as well. Each is a
            # thread for the relay's life; the default 3 were 2 for nothing (#53).
            num_workers=1,
            open=False,
            configure=self._configure,
            name=name,
            # A borrower waits this long for a connection (all busy, or none to be had)
            # before its call fails as DatabaseUnavailable and it retries later.
            timeout=30.0,
            # Failed connection attempts back off from 1 s, doubling; an attempt gives
            # up after this long and the next borrower starts a new one at once. So the
            # relay is back at most about 15 s after Postgres is, however long it was out.
            reconnect_timeout=30.0,
        )
        self._pool.open(wait=False)

    def connection(
        self, timeout: float | None = None
    ) -> AbstractContextManager[psycopg.Connection[Any]]:
        """Borrow a connection (given back, or discarded if broken, on exit), waiting
        at most ``timeout`` seconds (the pool's 30 s by default)."""
        return _Borrowed(self._pool, self._secret, timeout)

    def store(self, schema: str) -> OutboxStore:
        return PooledStore(self, schema)

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def permanent_refusal(self) -> RelayError | None:
        """The error of the last refused connection when no retry can fix it (an
        unknown database, a refused login: relay/adapters/postgres/db.py), else None. The pool itself
        only times out, so start-up asks this to stop instead of waiting for ever."""
        failure = _REFUSALS.last_failure
        if failure is None:
            return None
        error = db.classify(failure, self._secret)
        return None if isinstance(error, DatabaseUnavailable) else error

    def close(self, timeout: float = 5.0) -> None:
        self._pool.close(timeout)

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """Every new connection: the relay's settings on it (db.configure, the one place
        for them), and its share of the free slots."""
        db.configure(conn, self._timeouts)
        self._check_key_space(conn)
        free = self._free_slots(conn)
        if free < self._keep_free:
            conn.close()
            reason = (
                f"only {free} free connection slots would remain; the relay leaves at "
                f"least {self._keep_free} (keep_free_connections) to applications"
            )
            _REFUSALS.refused(reason, _KEEP_FREE)
            raise psycopg.OperationalError(reason)
        _REFUSALS.accepted()

    def _check_key_space(self, conn: psycopg.Connection[Any]) -> None:
        """Every relay connection checks that the database did not move before anything
        uses it (docs/design.md §6): a connection the pool opens after a failover may
        reach a restored cluster. The parts check again as they (re)start."""
        if self._on_connect is None:
            return
        try:
            self._on_connect(OutboxStore(conn, self._schema))
        except RelayError:
            return  # not migrated, say: start-up and the parts' own checks say so

    @staticmethod
    def _free_slots(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(_FREE_SLOTS).fetchone()
        assert row is not None
        return int(row[0])


class _Borrowed:
    """``pool.connection()``, its wait and its refusals as relay errors."""

    def __init__(
        self, pool: ConnectionPool[_RelayConnection], secret: str | None, timeout: float | None
    ) -> None:
        self._cm = pool.connection(timeout)
        self._secret = secret

    def __enter__(self) -> psycopg.Connection[Any]:
        with db.wrap_errors(self._secret):
            self._conn = self._cm.__enter__()
            return self._conn

    def __exit__(self, *exc: Any) -> None:
        if _read_only(exc[1]):
            # A standby's (a failover): closed, the pool replaces it with a connection
            # to the host that serves writes now, instead of lending it again.
            self._conn.close()
        self._cm.__exit__(*exc)


def _read_only(exc: BaseException | None) -> bool:
    while exc is not None:
        if getattr(exc, "sqlstate", None) == db.SqlState.READ_ONLY_SQL_TRANSACTION:
            return True
        exc = exc.__cause__
    return False


class PooledStore(OutboxStore):
    """An :class:`OutboxStore` whose every call borrows a connection from the pool:
    the store a part, the session keeper or an endpoint holds costs no backend while
    it waits. Calls nested in a call (``add`` lists) share its connection."""

    def __init__(self, pool: RelayPool, schema: str = "public") -> None:
        # No connection of its own: OutboxStore's methods run on a store made per call.
        self._pool = pool
        self.schema = schema

    def close(self) -> None:
        """Nothing to close: the pool owns the connections."""

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def transaction(self) -> AbstractContextManager[Any]:
        """Refused: each call borrows a connection of its own, so no transaction spans
        calls (a command writes through a store on one connection, ``relay.wiring``'s
        ``store_on``)."""
        raise TypeError(
            "a pooled store's calls each borrow a connection: no transaction spans them"
        )

    def prune(self, older_than_s: float, batch: int = 10_000) -> Iterator[int]:
        # A generator: one borrow for the whole pass, given back when it ends or is closed.
        with self._pool.connection() as conn:
            yield from OutboxStore(conn, self.schema).prune(older_than_s, batch)


def _borrowing(
    method: Callable[Concatenate[OutboxStore, P], R],
) -> Callable[Concatenate[PooledStore, P], R]:
    def borrowed(self: PooledStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._pool.connection() as conn:
            return method(OutboxStore(conn, self.schema), *args, **kwargs)

    functools.update_wrapper(borrowed, method)
    return borrowed


# Every public method of the store, present and future, borrows (but those above); its
# pieces' too (session_queries, intervention_queries, ...): dir() sees what it inherits.
for _name in dir(OutboxStore):
    _method = getattr(OutboxStore, _name)
    if callable(_method) and not _name.startswith("_") and _name not in vars(PooledStore):
        setattr(PooledStore, _name, _borrowing(_method))
