"""Periodic upkeep on the supervisor thread: retention, and warnings about a stalled horizon."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from relay.core.log_fields import log_extra
from relay.core.ports import DaemonStore
from relay.core.settings import Settings
from relay.daemon.membership import Membership
from relay.errors import RelayError

if TYPE_CHECKING:  # start-up checks the schema on a connection: not the port's business
    from relay.daemon.startup import KeySpaceChecks

logger = logging.getLogger(__name__)


class Retention:
    """Deletes published rows past ``retention``, then the dead letters whose retention
    is over (redriven ones whose rows are gone; with ``dead_letter_retention``, those
    not redriven decided longer ago), by one relay only: the one with the oldest live
    session id."""

    def __init__(
        self, settings: Settings, membership: Membership, key_space: KeySpaceChecks
    ) -> None:
        self._settings = settings
        self._membership = membership
        self._key_space = key_space
        # Rows and dead letters deleted, and passes that failed: /metrics
        # (outbox_relay_pruned_events, outbox_relay_pruned_dead_letters,
        # outbox_relay_prune_failures).
        self.totals: Counter[str] = Counter(pruned=0, dead_letters_pruned=0, failures=0)

    def prune(self, store: DaemonStore) -> None:
        """One retention pass. Its failure is its own (logged and counted here): the
        supervisor's rebalancing goes on, and the next pass tries again."""
        deleted = 0
        try:
            if not self._mine(store):
                return
            # A moved database's checkpoints are of the old key space until rebased.
            self._key_space.check(store, "retention")
            for batch in store.prune(self._settings.retention):
                deleted += batch
                self.totals["pruned"] += batch
            letters = self._prune_dead_letters(store)
        except RelayError as exc:
            self.totals["failures"] += 1
            logger.warning(
                "retention failed after pruning %s rows, published rows are kept until the "
                "next pass: %s",
                deleted,
                exc,
                extra=log_extra(
                    "retention_failed",
                    retention_failed=type(exc).__name__,
                    pruned=deleted,
                    error=exc,
                ),
            )
            return
        if deleted or letters:
            logger.info(
                "pruned %s published rows and %s dead letters",
                deleted,
                letters,
                extra=log_extra("retention_pruned", pruned=deleted, dead_letters_pruned=letters),
            )

    def _prune_dead_letters(self, store: DaemonStore) -> int:
        pending = self._settings.dead_letter_retention
        passes = [store.prune_dead_letters()]
        if pending is not None:  # the operator's word: these cannot be redriven after
            passes.append(store.prune_dead_letters(pending_older_than_s=pending))
        deleted = 0
        for batches in passes:
            for batch in batches:
                deleted += batch
                self.totals["dead_letters_pruned"] += batch
        return deleted

    def _mine(self, store: DaemonStore) -> bool:
        session = self._membership.session
        if session is None:
            return False
        sessions = store.live_sessions()
        return bool(sessions) and sessions[0] == session.id


class HorizonWatch:
    """Names the transactions that keep newer events from being published."""

    def __init__(self, settings: Settings) -> None:
        self._warn_after = settings.horizon_warn_after
        self._warned_blind = False

    def check(self, store: DaemonStore) -> None:
        if not self._warned_blind and not store.sees_all_backends():
            self._warned_blind = True
            logger.warning(
                "this relay's role cannot see other roles' transactions in pg_stat_activity "
                "(it lacks pg_read_all_stats): how long another role's transaction has held "
                "publication back is unknown, so it is not logged, and /metrics leaves out "
                "outbox_relay_horizon_held_seconds. `outbox-relay grant --relay-role ROLE "
                "--read-all-stats` allows it (the role then sees every session's query text)",
                extra=log_extra("horizon_unseen"),
            )
        for holder in store.horizon_holders():
            if holder.age_s is None:
                continue  # another role's session, hidden from this one (warned above)
            if holder.age_s < self._warn_after:
                break  # oldest first
            logger.warning(
                "publication held back %.0fs by %s (xid %s, %s, application %r, "
                "query started %s): events committed after it wait until it ends",
                holder.age_s,
                holder.describe(),
                holder.xid,
                holder.state,
                holder.application_name,
                holder.query_start,
                extra=log_extra(
                    "horizon_held",
                    horizon_pid=holder.pid,
                    horizon_xid=holder.xid,
                    horizon_age_s=holder.age_s,
                    horizon_state=holder.state,
                    horizon_application=holder.application_name,
                    horizon_gid=holder.gid,
                    horizon_owner=holder.owner,
                ),
            )
