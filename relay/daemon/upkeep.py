"""Periodic upkeep on the supervisor thread: retention, and warnings about a stalled horizon."""

from __future__ import annotations

import logging

from relay.daemon.membership import Membership
from relay.daemon.startup import KeySpaceChecks
from relay.settings import Settings
from relay.store import OutboxStore

logger = logging.getLogger(__name__)


class Retention:
    """Deletes published rows past ``retention``, by one relay only: the one with the
    oldest live session id."""

    def __init__(
        self, settings: Settings, membership: Membership, key_space: KeySpaceChecks
    ) -> None:
        self._settings = settings
        self._membership = membership
        self._key_space = key_space

    def prune(self, store: OutboxStore) -> None:
        session = self._membership.session
        if session is None:
            return
        sessions = store.live_sessions()
        if not sessions or sessions[0] != session.id:
            return
        # A moved database's checkpoints are of the old key space until rebased.
        self._key_space.check(store, "retention")
        deleted = sum(store.prune(self._settings.retention))
        if deleted:
            logger.info("pruned %s published rows", deleted, extra={"pruned": deleted})


class HorizonWatch:
    """Names the transactions that keep newer events from being published."""

    def __init__(self, settings: Settings) -> None:
        self._warn_after = settings.horizon_warn_after
        self._warned_blind = False

    def check(self, store: OutboxStore) -> None:
        if not self._warned_blind and not store.sees_all_backends():
            self._warned_blind = True
            logger.warning(
                "this relay's role cannot see other roles' transactions in pg_stat_activity "
                "(it lacks pg_read_all_stats): how long another role's transaction has held "
                "publication back is unknown, so it is not logged, and /metrics leaves out "
                "outbox_relay_horizon_held_seconds. `outbox-relay grant --relay-role ROLE "
                "--read-all-stats` allows it (the role then sees every session's query text)"
            )
        for holder in store.horizon_holders():
            if holder.age_s is None:
                continue  # another role's session, hidden from this one (warned above)
            if holder.age_s < self._warn_after:
                break  # oldest first
            logger.warning(
                "publication held back %.0fs by pid %s (xid %s, %s, application %r, "
                "query started %s): events committed after it wait until it ends",
                holder.age_s,
                holder.pid,
                holder.xid,
                holder.state,
                holder.application_name,
                holder.query_start,
                extra={
                    "horizon_pid": holder.pid,
                    "horizon_xid": holder.xid,
                    "horizon_age_s": holder.age_s,
                    "horizon_state": holder.state,
                    "horizon_application": holder.application_name,
                },
            )
