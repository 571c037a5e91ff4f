"""The outbox store's sessions and claims (docs/design.md §4): a relay's session kept
alive, expired ones deleted, parts claimed and released (a piece of
:class:`~relay.adapters.postgres.store.OutboxStore`)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from psycopg.rows import dict_row

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.store_base import StoreBase
from relay.core.ports import ExpiredSession


class SessionQueries(StoreBase):
    """The relays' sessions, and the claims they hold on parts."""

    # -- sessions and claims (design §4) ------------------------------------------------

    def open_session(self, hostname: str, pid: int, timeout: float) -> UUID:
        params = {"hostname": hostname, "pid": pid, "timeout": timeout}
        with wrap_errors():
            row = self.conn.execute(self._q["open_session"], params).fetchone()
        assert row is not None
        return UUID(str(row[0]))

    def heartbeat(self, session: UUID, timeout: float) -> bool:
        """Extend ``session``; False when it is gone (expired and deleted by a peer)."""
        with wrap_errors():
            row = self.conn.execute(
                self._q["heartbeat"], {"id": session, "timeout": timeout}
            ).fetchone()
        return row is not None

    def expire_sessions(self) -> list[ExpiredSession]:
        """Delete expired sessions (their claims become free); returns them."""
        with wrap_errors():
            rows = self.conn.execute(self._q["expire_sessions"]).fetchall()
        return [ExpiredSession(UUID(str(r[0])), r[1], r[2]) for r in rows]

    def next_expiry(self) -> float | None:
        with wrap_errors():
            row = self.conn.execute(self._q["next_expiry"]).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def close_session(self, session: UUID) -> None:
        with wrap_errors():
            self.conn.execute(self._q["close_session"], {"id": session})

    def live_sessions(self) -> list[UUID]:
        with wrap_errors():
            rows = self.conn.execute(self._q["live_sessions"]).fetchall()
        return [UUID(str(r[0])) for r in rows]

    def list_sessions(self) -> list[dict[str, Any]]:
        with wrap_errors():
            return (
                self.conn.cursor(row_factory=dict_row).execute(self._q["list_sessions"]).fetchall()
            )

    def claim(self, name: str, part: int, owner: UUID) -> bool:
        """Claim the free part for ``owner``; False when someone holds it."""
        return self._set_owner("claim_part", name, part, owner)

    def release(self, name: str, part: int, owner: UUID) -> bool:
        """Free the part; False when ``owner`` does not hold it."""
        return self._set_owner("release_part", name, part, owner)

    def _set_owner(self, query: str, name: str, part: int, owner: UUID) -> bool:
        """Run ``query`` (claim_part, release_part); whether it changed the owner."""
        params = {"name": name, "part": part, "owner": owner}
        with wrap_errors():
            return self.conn.execute(self._q[query], params).fetchone() is not None
