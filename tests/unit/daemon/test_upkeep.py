"""Retention through the daemon's store port, over the in-memory store: one relay
prunes (the one with the oldest live session id), and only what every part published."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from relay.adapters.memory import InMemoryStore
from relay.core.ports import RelaySession
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon.startup import KeySpaceChecks
from relay.daemon.upkeep import Retention
from tests.contracts.store import event

LAST = uuid.UUID(int=2**128 - 1)


@dataclass
class _Membership:
    session: RelaySession | None


def retention(session_id: uuid.UUID | None) -> Retention:
    session = None if session_id is None else RelaySession(session_id, 60, 1)
    membership = _Membership(session)
    return Retention(Settings(retention=3600), membership, KeySpaceChecks())  # type: ignore[arg-type]


def old_store() -> InMemoryStore:
    """Two day-old events; the one subscriber published the first only."""
    store = InMemoryStore()
    day_ago = datetime.now(UTC) - timedelta(days=1)
    first, _ = (store.append(event(k), recorded_at=day_ago.timestamp()) for k in "ab")
    store.add(Subscriber("s", topic="s", value_format=ValueFormat.JSON))
    # A peer whose session opened first, but whose id sorts last.
    store.open_session("peer", 2, 60, session_id=LAST)
    me = store.open_session("host", 1, 60)
    assert store.claim("s", 0, me)
    store.advance(store.get_part("s", 0), first.key, me)
    return store


def test_the_relay_of_the_oldest_session_prunes_what_was_published() -> None:
    store = old_store()
    oldest = min(store.live_sessions())
    pruner = retention(oldest)
    pruner.prune(store)
    assert [e.aggregate_id for e in store.events] == ["b"]
    assert pruner.totals["pruned"] == 1 and pruner.totals["failures"] == 0


def test_another_relay_and_one_without_a_session_leave_it() -> None:
    store = old_store()
    retention(LAST).prune(store)
    retention(None).prune(store)
    assert [e.aggregate_id for e in store.events] == ["a", "b"]
