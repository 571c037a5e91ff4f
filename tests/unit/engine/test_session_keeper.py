"""The session keeper (relay/engine/sessions.py) over the in-memory store: it heartbeats this
relay's session, expires its dead peers', and when a peer expired its own, gives the
parts up and opens a new one."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from relay.adapters.memory import InMemoryStore
from relay.core.subscribers import Subscriber, ValueFormat
from relay.engine.sessions import SessionKeeper
from tests.support import wait_until

# How long a condition may take to hold on a busy machine (never a figure asserted).
WAIT = 60.0

SUBSCRIBER = Subscriber("s", topic="t", value_format=ValueFormat.JSON)


@pytest.fixture
def store() -> InMemoryStore:
    return InMemoryStore()


@pytest.fixture
def lost() -> threading.Event:
    return threading.Event()


@pytest.fixture
def keeper(store: InMemoryStore, lost: threading.Event) -> Iterator[SessionKeeper]:
    keeper = SessionKeeper(lambda: store, timeout=60, heartbeat_interval=0.02, on_lost=lost.set)
    keeper.start()
    yield keeper
    keeper.close(timeout=5)


def test_the_keeper_opens_a_live_session(store: InMemoryStore, keeper: SessionKeeper) -> None:
    assert store.live_sessions() == [keeper.session.id]
    assert keeper.session.valid()


def test_the_keeper_expires_a_dead_peers_session_and_frees_its_parts(
    store: InMemoryStore, keeper: SessionKeeper
) -> None:
    store.add(SUBSCRIBER)
    peer = store.open_session("peer", 2, -1.0)  # its heartbeats stopped long ago
    assert store.claim("s", 0, peer)
    wait_until(
        lambda: peer not in store.sessions, what="the peer's session to be expired", timeout=WAIT
    )
    assert store.get_part("s", 0).owner is None
    assert store.live_sessions() == [keeper.session.id]


def test_a_keeper_whose_session_a_peer_expired_gives_up_and_opens_another(
    store: InMemoryStore, keeper: SessionKeeper, lost: threading.Event
) -> None:
    old = keeper.session
    store.close_session(old.id)  # as a peer does to a session past its expiry
    wait_until(lost.is_set, what="the keeper to find its session gone", timeout=WAIT)
    assert old.lost.is_set() and not old.valid(), "its workers stop publishing"
    wait_until(lambda: keeper.session is not old, what="a new session", timeout=WAIT)
    assert store.live_sessions() == [keeper.session.id]


def test_closing_the_keeper_deletes_its_session(
    store: InMemoryStore, keeper: SessionKeeper
) -> None:
    store.add(SUBSCRIBER)
    assert store.claim("s", 0, keeper.session.id)
    keeper.close(timeout=5)
    assert store.sessions == {} and store.get_part("s", 0).owner is None


def test_expiring_a_peers_session_wakes_the_supervisor(store: InMemoryStore) -> None:
    # The freed parts are claimed at once, not a supervisor tick later (issue #49).
    woken = threading.Event()
    keeper = SessionKeeper(
        lambda: store,
        timeout=60,
        heartbeat_interval=0.02,
        on_lost=lambda: None,
        on_peer_expired=woken.set,
    )
    keeper.start()
    try:
        store.open_session("peer", 2, -1.0)  # its heartbeats stopped long ago
        wait_until(woken.is_set, what="the keeper to tell of the expired peer", timeout=WAIT)
    finally:
        keeper.close(timeout=5)
