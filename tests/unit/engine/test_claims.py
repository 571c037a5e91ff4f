"""Claiming, releasing, retiring and assignment: how the daemon spreads the parts over
the live relays (docs/design.md §4), over the in-memory store, with no servers.

Each relay here is what the daemon's supervisor rebalances (``ClaimedParts``) with its
session, sharing one store; their workers run over the in-memory store and publisher.
A relay hands a part over in two rounds (stop its worker, then release it once the
worker is gone), so the tests rebalance every relay until what they expect holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import PartId, Position
from relay.core.ports import PartState, Publisher, RelaySession
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, TopicGuard, ValueFormat
from relay.daemon.context import DaemonContext
from relay.daemon.parts import ClaimedParts
from relay.engine.encoding import RecordEncoder
from relay.engine.sessions import assign
from relay.errors import CheckpointConflict, ConfigError
from tests.support import wait_until

# How long a condition may take to hold on a busy machine (never a figure asserted).
WAIT = 60.0

TIMEOUT = 60.0  # the session timeout of every relay here: none expires unless told to


class Clock:
    """The store's clock, moved by the test: sessions expire when it says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Membership:
    """The part of ``Membership`` that ``ClaimedParts`` reads: the session, if any."""

    session: RelaySession | None


class Relay:
    """One relay's claims and workers, on its own session."""

    def __init__(self, store: InMemoryStore, open_publisher: Any = None) -> None:
        self.store = store
        self.membership = _Membership(None)
        self.open()
        settings = Settings(poll_interval=0.05, shutdown_timeout=10)
        context = DaemonContext(settings, lambda: store, threading.Event())
        self.parts = ClaimedParts(
            context,
            self.membership,  # type: ignore[arg-type]
            topic_guard=TopicGuard(settings.checkpoint_topic, None),
            encoder=RecordEncoder(None),
            open_publisher=open_publisher or (lambda state: InMemoryPublisher()),
        )

    @property
    def session(self) -> RelaySession:
        assert self.membership.session is not None
        return self.membership.session

    def open(self) -> None:
        session_id = self.store.open_session("host", 1, TIMEOUT)
        self.membership.session = RelaySession(session_id, TIMEOUT, heartbeat_interval=1)

    def rebalance(self) -> None:
        self.parts.rebalance(self.store)

    def running(self) -> set[PartId]:
        return {part for part, worker in self.parts.workers.items() if worker.is_alive()}

    def stop(self) -> None:
        self.parts.stop_all()


def three(name: str = "three") -> Subscriber:
    return Subscriber(name, topic=name, value_format=ValueFormat.JSON, parts=3)


def one(name: str) -> Subscriber:
    return Subscriber(name, topic=name, value_format=ValueFormat.JSON)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> InMemoryStore:
    store = InMemoryStore(clock)
    store.add(three())
    store.add(one("solo"))
    return store


@pytest.fixture
def relays(store: InMemoryStore) -> Iterator[list[Relay]]:
    """Relays made by the test, stopped at its end."""
    made: list[Relay] = []
    yield made
    for relay in made:
        relay.stop()


def start(relays: list[Relay], store: InMemoryStore, **kwargs: Any) -> Relay:
    relay = Relay(store, **kwargs)
    relays.append(relay)
    return relay


def owners(store: InMemoryStore) -> dict[PartId, UUID | None]:
    return {PartId(p.name, p.part): p.owner for s in store.list() for p in s.parts}


def expected(store: InMemoryStore, relays: list[Relay]) -> dict[PartId, UUID]:
    """Each part's owner by the assignment over the live sessions of ``relays``."""
    live = [r.session.id for r in relays if r.session.id in store.live_sessions()]
    return assign(list(owners(store)), live)


def settled(store: InMemoryStore, relays: list[Relay]) -> bool:
    """Rebalance every relay once; whether each part is claimed by its assigned relay,
    which runs its worker (and no other relay runs one)."""
    for relay in relays:
        relay.rebalance()
    want = expected(store, relays)
    running = {r.session.id: r.running() for r in relays}
    return owners(store) == want and all(
        running[r.session.id] == {p for p, o in want.items() if o == r.session.id} for r in relays
    )


def settle(store: InMemoryStore, relays: list[Relay]) -> None:
    wait_until(
        lambda: settled(store, relays), what="the claims to match the assignment", timeout=WAIT
    )


def test_the_assignment_is_round_robin_over_the_sorted_sessions() -> None:
    a, b = UUID(int=2), UUID(int=1)
    parts = [PartId("s", 2), PartId("s", 0), PartId("s", 1)]
    assert assign(parts, [a, b]) == {PartId("s", 0): b, PartId("s", 1): a, PartId("s", 2): b}
    assert assign(parts, []) == {}


def test_a_lone_relay_claims_every_part(store: InMemoryStore, relays: list[Relay]) -> None:
    relay = start(relays, store)
    settle(store, relays)
    assert set(owners(store).values()) == {relay.session.id}
    assert relay.running() == set(owners(store))


def test_the_parts_spread_over_the_live_relays(store: InMemoryStore, relays: list[Relay]) -> None:
    first, second = start(relays, store), start(relays, store)
    settle(store, relays)
    claimed = owners(store)
    assert sorted(claimed.values()) == sorted(
        [first.session.id, first.session.id, second.session.id, second.session.id]
    )
    assert first.running().isdisjoint(second.running())


def test_a_relay_that_joins_gets_its_share_from_the_one_that_held_it(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    first = start(relays, store)
    settle(store, relays)
    second = start(relays, store)
    second.rebalance()
    assert second.running() == set(), "its share is still claimed by the first relay"
    settle(store, relays)
    assert {o for o in owners(store).values()} == {first.session.id, second.session.id}


def test_the_parts_of_an_expired_relay_go_to_the_live_ones(
    store: InMemoryStore, clock: Clock, relays: list[Relay]
) -> None:
    first, second = start(relays, store), start(relays, store)
    settle(store, relays)
    clock.now += TIMEOUT + 1  # the second relay's heartbeats stopped...
    assert store.heartbeat(first.session.id, TIMEOUT)  # ...the first's did not
    expired = store.expire_sessions()
    assert [e.id for e in expired] == [second.session.id]
    second.session.lost.set()  # what its keeper does when it finds out
    assert not any(o == second.session.id for o in owners(store).values())
    settle(store, [first])
    assert set(owners(store).values()) == {first.session.id}
    wait_until(
        lambda: second.running() == set(), what="the expired relay's workers to stop", timeout=WAIT
    )


def test_a_relay_that_closes_its_session_gives_every_part_up_at_once(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    first, second = start(relays, store), start(relays, store)
    settle(store, relays)
    second.stop()
    store.close_session(second.session.id)
    settle(store, [first])
    assert set(owners(store).values()) == {first.session.id}


def test_a_relay_without_a_session_claims_nothing(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    relay = start(relays, store)
    relay.membership.session = None
    relay.rebalance()
    assert set(owners(store).values()) == {None} and relay.running() == set()


def test_a_relay_whose_session_may_have_expired_claims_nothing_more(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    relay = start(relays, store)
    relay.session.lost.set()
    relay.rebalance()
    assert set(owners(store).values()) == {None} and relay.running() == set()


def test_a_new_subscriber_moves_the_parts_to_their_new_owners(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    """Parts are assigned in sorted order: a subscriber added before the others in it
    shifts every later part to the next relay; each moved part is handed over."""
    start(relays, store), start(relays, store)
    settle(store, relays)
    before = owners(store)
    store.add(one("a-first"))
    settle(store, relays)
    after = owners(store)
    assert after[PartId("a-first", 0)] is not None
    moved = [p for p in before if before[p] != after[p]]
    assert moved, "the new part shifted the assignment"


def test_a_removed_subscribers_workers_are_retired_and_the_rest_go_on(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    relay = start(relays, store)
    settle(store, relays)
    store.remove("three")
    settle(store, relays)
    assert relay.running() == {PartId("solo", 0)}

    def retired() -> bool:
        # A worker that has stopped is retired on the relay's next round, not at once.
        relay.rebalance()
        return set(relay.parts.workers) == {PartId("solo", 0)}

    wait_until(retired, what="the removed subscriber's workers to be retired", timeout=WAIT)
    # Its statistics stay: counters never go down.
    assert PartId("three", 2) in relay.parts.totals()
    assert relay.parts.totals()[PartId("three", 2)]["failures"] == 0


def test_a_worker_that_fails_for_good_is_retired_and_its_part_halted(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    """A fault no retry can fix (a refused Kafka setting, a missing privilege) halts the
    part in the store, as a poison event does: every relay sees why, and none retries
    it in a silent loop until it is resumed."""

    def refuse(state: PartState) -> Publisher:
        if state.name == "solo":
            raise ConfigError("the broker refused a setting")
        return InMemoryPublisher()

    relay = start(relays, store, open_publisher=refuse)
    solo = PartId("solo", 0)
    wait_until(
        lambda: relay.rebalance() or relay.parts.totals().get(solo, {}).get("failures") == 1,
        what="the failed worker to be retired",
        timeout=WAIT,
    )
    halted = store.get_part("solo", 0)
    assert halted.halted_error is not None and "refused a setting" in halted.halted_error
    assert halted.owner == relay.session.id, "still claimed: resuming it needs no hand-over"
    assert all(p.halted_error is None for p in store.list("three")[0].parts)


def test_a_part_handed_over_is_fenced_from_its_former_owner(
    store: InMemoryStore, relays: list[Relay]
) -> None:
    """The hand-over's safety: a checkpoint write of a part its former owner read
    before the hand-over fails (release and claim moved the version on)."""
    first = start(relays, store)
    settle(store, relays)
    first.stop()  # its workers stop; it still holds its claims
    read_before = {PartId(p.name, p.part): p for s in store.list() for p in s.parts}
    second = start(relays, store)
    settle(store, relays)
    moved = [part for part, owner in owners(store).items() if owner == second.session.id]
    assert moved
    for part in moved:
        with pytest.raises(CheckpointConflict):
            store.advance(read_before[part], Position(1, 0), first.session.id)
