"""Relay sessions (docs/design.md §4): heartbeats, expiry, and which parts each relay should own.

Every relay process holds one session row and heartbeats it. Any relay deletes
sessions past their expiry, which frees their claims. Parts are spread over the live
sessions deterministically, so every relay computes the same assignment from the
same table contents and the work converges without a leader.

All of it goes through the daemon's store port (``relay.core.ports.DaemonStore``); the lease
the workers check, :class:`RelaySession`, lives next to the ports.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from uuid import UUID

from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import DaemonStore, RelaySession
from relay.errors import RelayError

# RelaySession moved to relay.core.ports; importers of it from here keep working.
__all__ = ["RelaySession", "SessionKeeper", "assign"]

logger = logging.getLogger(__name__)

# A session is expired once past its expiry: look just after it, never in a busy loop.
_EXPIRY_SLACK_S = 0.05
_MIN_WAIT_S = 0.05


def assign(parts: Sequence[PartId], sessions: Sequence[UUID]) -> dict[PartId, UUID]:
    """Round-robin the sorted parts over the sorted live sessions."""
    if not sessions:
        return {}
    ordered = sorted(sessions)
    return {part: ordered[i % len(ordered)] for i, part in enumerate(sorted(parts))}


class SessionKeeper(threading.Thread):
    """Heartbeats this relay's session and expires dead peers' sessions."""

    def __init__(
        self,
        open_store: Callable[[], DaemonStore],
        *,
        timeout: float,
        heartbeat_interval: float,
        on_lost: Callable[[], None],
        on_peer_expired: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="relay-session", daemon=True)
        # Called once a beat expired some peer's session: its parts are free now, and
        # the supervisor claims them at once rather than at its next tick (issue #49).
        self._on_peer_expired = on_peer_expired
        # When the soonest live session runs out (monotonic; None: unknown).
        self._peer_expires_at: float | None = None
        self._open_store = open_store
        self._timeout = timeout
        self._interval = heartbeat_interval
        self._on_lost = on_lost
        self._stopping = threading.Event()
        self._store: DaemonStore | None = None
        # The last heartbeat's failure (None once one succeeds): /readyz says it, so a
        # permanent one (a revoked grant, a changed password) is not taken for an outage.
        self.last_error: RelayError | None = None
        self.session = self._open()

    def _open(self) -> RelaySession:
        store = self._held_store()
        session_id = store.open_session(socket.gethostname(), os.getpid(), self._timeout)
        logger.info(
            "opened relay session %s",
            session_id,
            extra=log_extra("session_opened", session=session_id),
        )
        return RelaySession(session_id, self._timeout, self._interval)

    def stop(self) -> None:
        self._stopping.set()

    def close(self, timeout: float = 10.0) -> None:
        """Delete the session: every claim is released at once (cooperative release).

        Bounded by ``timeout``: with Postgres unreachable, the session simply expires.
        """
        deadline = time.monotonic() + timeout
        self.stop()
        if self.is_alive():
            self.join(timeout / 2)  # no heartbeat may reopen a session after this
        closer = threading.Thread(target=self._close_session, name="relay-session-close")
        closer.daemon = True
        closer.start()
        closer.join(max(0.5, deadline - time.monotonic()))
        if closer.is_alive():
            logger.warning(
                "could not close session %s in time; it will expire",
                self.session.id,
                extra=self._log_extra("session_close_overdue"),
            )

    def _close_session(self) -> None:
        try:
            store = self._open_store()  # a fresh connection: the old one may be wedged
            try:
                store.close_session(self.session.id)
            finally:
                store.close()
            logger.info(
                "closed relay session %s",
                self.session.id,
                extra=self._log_extra("session_closed"),
            )
        except RelayError as exc:
            logger.warning(
                "could not close session %s: %s",
                self.session.id,
                exc,
                extra=self._log_extra("session_close_failed", error=exc),
            )

    def run(self) -> None:
        beat_due = time.monotonic() + self._interval
        try:
            while not self._stopping.wait(self._next_wait(beat_due)):
                try:
                    if time.monotonic() >= beat_due:
                        beat_due = time.monotonic() + self._interval
                        self._beat()
                    self._expire_peers()
                    self.last_error = None
                except RelayError as exc:
                    self.last_error = exc
                    self._peer_expires_at = None
                    logger.warning(
                        "session heartbeat failed: %s",
                        exc,
                        extra=self._log_extra("session_heartbeat_failed", error=exc),
                    )
                    self._disconnect()
        finally:
            self._disconnect()

    def _next_wait(self, beat_due: float) -> float:
        """Until the next beat, or just past the soonest session's expiry if sooner: a
        peer cut off is expired when its session runs out, not up to a beat later."""
        now = time.monotonic()
        due = beat_due
        if self._peer_expires_at is not None:
            due = min(due, self._peer_expires_at + _EXPIRY_SLACK_S)
        return max(_MIN_WAIT_S, due - now)

    def _beat(self) -> None:
        store = self._held_store()
        session = self.session
        sent = time.monotonic()  # the database's expiry counts from about now
        if store.heartbeat(session.id, self._timeout):
            session.renewed(sent)
        else:
            logger.error(
                "relay session %s expired (heartbeats stopped for longer than %.0fs); "
                "its claims now belong to other relays",
                session.id,
                self._timeout,
                extra=self._log_extra("session_expired"),
            )
            session.lost.set()
            self._on_lost()
            if not self._stopping.is_set():
                self.session = self._open()

    def _expire_peers(self) -> None:
        """Delete the sessions past their expiry (a peer's freed parts wake the
        supervisor), and note when the next one runs out."""
        store = self._held_store()
        expired_any = False
        for expired, host, pid in store.expire_sessions():
            expired_any = True
            logger.warning(
                "expired the session %s of relay %s (pid %s): its parts are free",
                expired,
                host,
                pid,
                extra=log_extra("session_peer_expired", session=expired, host=host, pid=pid),
            )
        if expired_any:
            self._on_peer_expired()
        left = store.next_expiry()
        self._peer_expires_at = None if left is None else time.monotonic() + left

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this session's log lines: the event, the session, then ``fields``."""
        return log_extra(event, session=self.session.id, **fields)

    def _held_store(self) -> DaemonStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def _disconnect(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            finally:
                self._store = None
