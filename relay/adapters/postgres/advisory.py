"""Advisory locks the relay's commands take, and who holds one they wait for.

Any role that can log in may take any advisory lock key, a role with no grant
included: a wait for one must be bounded, and its refusal must name the session to
end (issue #47)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import psycopg
from psycopg import errors as pg_errors

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import queries_for
from relay.core.log_fields import log_extra
from relay.errors import LockTimeout, SubscriberError

logger = logging.getLogger(__name__)


class LockHolder(NamedTuple):
    """A session holding an advisory lock: what pg_stat_activity shows of it to any role."""

    pid: int
    role: str | None
    application: str | None

    def __str__(self) -> str:
        return f"pid {self.pid} (role {self.role or '?'}, application {self.application or ''!r})"


def lock_holder(conn: psycopg.Connection[Any], key: int) -> LockHolder | None:
    """The session holding the advisory lock ``key`` in this database, if one does."""
    with wrap_errors():
        row = conn.execute(_queries()["advisory_lock_holder"], {"key": key}).fetchone()
    return None if row is None else LockHolder(*row)


@contextmanager
def session_lock(
    conn: psycopg.Connection[Any], lock: bytes, unlock: bytes, params: Mapping[str, Any], what: str
) -> Iterator[None]:
    """Hold a session advisory lock while the block runs: ``lock`` tries it (returning
    its key and whether it was granted), ``unlock`` releases it. When another session
    holds it, :class:`SubscriberError` naming that session: another ``what`` runs."""
    with wrap_errors():
        row = conn.execute(lock, params).fetchone()
    assert row is not None
    if not row[1]:
        holder = lock_holder(conn, row[0])
        raise SubscriberError(
            f"another {what} is running: its lock is held by "
            f"{holder or 'a session that has just ended'} (if that is no outbox-relay, "
            "end it with pg_terminate_backend)"
        )
    try:
        yield
    finally:
        if not conn.closed:
            with wrap_errors():
                conn.execute(unlock, params)


def hold_xact_lock(conn: psycopg.Connection[Any], key: int, wait_s: float, what: str) -> None:
    """Take the transaction advisory lock ``key`` (inside a transaction), waiting at most
    ``wait_s`` seconds; :class:`LockTimeout` naming the holder if it is not granted by
    then. The rest of the transaction keeps the session's own ``lock_timeout``."""
    queries = _queries()
    with wrap_errors():
        row = conn.execute(queries["advisory_try_xact_lock"], {"key": key}).fetchone()
    if row is not None and row[0]:
        return
    holder = lock_holder(conn, key)
    logger.info(
        "waiting up to %.0f s for the %s lock, held by %s",
        wait_s,
        what,
        holder or "a session that has just ended",
        extra=log_extra("advisory_lock_waiting", lock=what, holder=str(holder), wait_s=wait_s),
    )
    params = {"key": key, "wait_ms": str(round(wait_s * 1000))}
    with wrap_errors():
        try:
            row = conn.execute(queries["advisory_xact_lock"], params).fetchone()
        except pg_errors.LockNotAvailable as exc:
            raise LockTimeout(_refusal(what, wait_s, holder)) from exc
        assert row is not None
        conn.execute(queries["restore_lock_timeout"], {"lock_timeout": row[0]})


def _refusal(what: str, wait_s: float, holder: LockHolder | None) -> str:
    held = f"held by {holder}" if holder else "held by a session that has ended since"
    end = (
        f"; if it is not another outbox-relay, end it: SELECT pg_terminate_backend({holder.pid})"
        if holder
        else ""
    )
    return f"the {what} lock was not granted within {wait_s:g} s: {held}{end}"


def _queries() -> dict[str, bytes]:
    return queries_for("public")  # they name no table: any schema will do
