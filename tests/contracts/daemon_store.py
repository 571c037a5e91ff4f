"""The daemon's store port's contract (``relay.core.ports.DaemonStore``): sessions, claims,
the subscribers' listing, halting and retention, as the relay daemon relies on them
(docs/design.md §4). Held against the Postgres store and the in-memory one alike, so
the unit tests of claiming and assignment over the in-memory store
(``tests/unit/engine/test_claims.py``) say something about the real one.
``tests/unit/adapters/memory/test_daemon_store_contract.py`` and
``tests/integration/test_daemon_store_contract.py`` subclass it once per adapter.

A session's expiry is tested with a session opened already expired (a negative
timeout): no clock is waited on.
"""

from __future__ import annotations

import uuid

import pytest

from relay.core.model import Position
from relay.core.ports import DaemonStore, DeadLetter, DeadLetterDecision, Selection
from relay.core.subscribers import StartFrom, Subscriber, ValueFormat
from relay.errors import CheckpointConflict, ClaimLost, RelayError, SubscriberError
from tests.contracts.store import Write

ONE = Subscriber("one", topic="one", value_format=ValueFormat.JSON)
THREE = Subscriber("three", topic="three", value_format=ValueFormat.JSON, parts=3)
# Already expired when opened: what a relay's session is once its heartbeats stopped.
EXPIRED = -1.0


class DaemonStoreContract:
    """Subclassed once per adapter, with ``store`` and ``write`` fixtures."""

    # -- sessions ----------------------------------------------------------------------

    def test_an_open_session_is_live_until_closed(self, store: DaemonStore) -> None:
        session = store.open_session("host-a", 4242, 60)
        assert session in store.live_sessions()
        assert store.heartbeat(session, 60)
        store.close_session(session)
        assert session not in store.live_sessions()
        assert not store.heartbeat(session, 60), "a closed session is not heartbeaten back"

    def test_live_sessions_come_in_id_order(self, store: DaemonStore) -> None:
        """Every relay spreads the parts over the same list: the order is part of it."""
        opened = {store.open_session("host", n, 60) for n in range(4)}
        assert [s for s in store.live_sessions() if s in opened] == sorted(opened)

    def test_a_session_past_its_expiry_is_not_live_and_is_expired_once(
        self, store: DaemonStore
    ) -> None:
        live = store.open_session("host-a", 1, 60)
        dead = store.open_session("host-b", 2, EXPIRED)
        assert dead not in store.live_sessions() and live in store.live_sessions()
        expired = store.expire_sessions()
        assert [(e.id, e.hostname, e.pid) for e in expired] == [(dead, "host-b", 2)]
        assert store.expire_sessions() == []
        assert not store.heartbeat(dead, 60), "an expired session cannot come back"
        assert store.live_sessions() == [live]

    def test_a_heartbeat_moves_the_expiry_on(self, store: DaemonStore) -> None:
        session = store.open_session("host", 1, EXPIRED)
        assert store.heartbeat(session, 60)
        assert store.expire_sessions() == [] and session in store.live_sessions()

    def test_the_next_expiry_is_the_soonest_live_sessions(self, store: DaemonStore) -> None:
        assert store.next_expiry() is None
        store.open_session("host-a", 1, 60)
        store.open_session("host-b", 2, 30)
        store.open_session("host-c", 3, EXPIRED)  # past its expiry: not waited for
        soonest = store.next_expiry()
        assert soonest is not None and 20 < soonest <= 30

    # -- claims ------------------------------------------------------------------------

    def test_a_new_subscriber_has_every_part_free(self, store: DaemonStore) -> None:
        assert store.add(THREE)
        [listed] = store.list("three")
        assert [p.part for p in listed.parts] == [0, 1, 2]
        assert all(p.owner is None and p.halted_error is None for p in listed.parts)
        assert all(p.subscriber_id == listed.subscriber_id for p in listed.parts)
        assert listed.checkpoint == Position(0, 0)

    def test_a_free_part_is_claimed_once(self, store: DaemonStore) -> None:
        store.add(THREE)
        me, peer = store.open_session("a", 1, 60), store.open_session("b", 2, 60)
        assert store.claim("three", 1, me)
        assert not store.claim("three", 1, peer)
        assert not store.claim("three", 1, me), "a claim is of a free part only"
        owners = {p.part: p.owner for p in store.list("three")[0].parts}
        assert owners == {0: None, 1: me, 2: None}

    def test_a_missing_part_is_not_claimed(self, store: DaemonStore) -> None:
        store.add(ONE)
        me = store.open_session("a", 1, 60)
        assert not store.claim("nobody", 0, me)
        assert not store.claim("one", 1, me)

    def test_only_a_session_claims_a_part(self, store: DaemonStore) -> None:
        store.add(ONE)
        with pytest.raises(RelayError):
            store.claim("one", 0, uuid.uuid4())
        assert store.get_part("one", 0).owner is None

    def test_a_part_is_released_by_its_owner_only(self, store: DaemonStore) -> None:
        store.add(ONE)
        me, peer = store.open_session("a", 1, 60), store.open_session("b", 2, 60)
        assert store.claim("one", 0, me)
        assert not store.release("one", 0, peer)
        assert store.get_part("one", 0).owner == me
        assert store.release("one", 0, me)
        assert store.get_part("one", 0).owner is None
        assert not store.release("one", 0, me), "released already"
        assert store.claim("one", 0, peer), "a released part is free for a peer"

    def test_claiming_and_releasing_fence_earlier_checkpoint_writes(
        self, store: DaemonStore, write: Write
    ) -> None:
        """A worker that read the part before a claim or release moved it on cannot
        write its checkpoint (the CAS fails): a relay that lost a part publishes nothing
        more for it."""
        write("k")
        [event] = store.fetch(Position(0, 0), Selection(10)).events
        store.add(ONE)
        me = store.open_session("a", 1, 60)
        before_claim = store.get_part("one", 0)
        assert store.claim("one", 0, me)
        with pytest.raises(CheckpointConflict):
            store.advance(before_claim, event.key, me)
        claimed = store.get_part("one", 0)
        assert claimed.version != before_claim.version
        assert store.release("one", 0, me)
        assert store.claim("one", 0, me)
        with pytest.raises(CheckpointConflict):
            store.advance(claimed, event.key, me)
        assert store.get_part("one", 0).checkpoint == Position(0, 0)

    def test_an_expired_session_frees_its_parts(self, store: DaemonStore) -> None:
        store.add(THREE)
        dead, peer = store.open_session("a", 1, EXPIRED), store.open_session("b", 2, 60)
        assert store.claim("three", 0, dead) and store.claim("three", 1, peer)
        store.expire_sessions()
        owners = {p.part: p.owner for p in store.list("three")[0].parts}
        assert owners == {0: None, 1: peer, 2: None}
        assert store.claim("three", 0, peer)

    def test_a_closed_session_frees_its_parts_at_once(self, store: DaemonStore) -> None:
        store.add(THREE)
        me = store.open_session("a", 1, 60)
        assert store.claim("three", 0, me) and store.claim("three", 2, me)
        store.close_session(me)
        assert all(p.owner is None for p in store.list("three")[0].parts)

    def test_an_expired_owner_cannot_write_its_checkpoint(
        self, store: DaemonStore, write: Write
    ) -> None:
        write("k")
        [event] = store.fetch(Position(0, 0), Selection(10)).events
        store.add(ONE)
        dead = store.open_session("a", 1, EXPIRED)
        assert store.claim("one", 0, dead)
        state = store.get_part("one", 0)
        store.expire_sessions()
        with pytest.raises(CheckpointConflict):
            store.advance(state, event.key, dead)
        with pytest.raises(ClaimLost):
            store.halt(state, dead, "poison")

    # -- halting -----------------------------------------------------------------------

    def test_a_halt_stops_one_part_and_the_listing_says_why(self, store: DaemonStore) -> None:
        store.add(THREE)
        me = store.open_session("a", 1, 60)
        assert store.claim("three", 1, me)
        store.halt(store.get_part("three", 1), me, "a poison event")
        halts = {p.part: p.halted_error for p in store.list("three")[0].parts}
        assert halts == {0: None, 1: "a poison event", 2: None}
        assert store.release("three", 1, me)
        assert store.get_part("three", 1).halted_error == "a poison event", "until resumed"

    # -- the subscribers ---------------------------------------------------------------

    def test_the_listing_holds_every_subscriber_by_name(self, store: DaemonStore) -> None:
        store.add(THREE)
        store.add(ONE)
        assert [s.subscriber.name for s in store.list()] == ["one", "three"]
        assert [s.subscriber.name for s in store.list("three")] == ["three"]
        assert store.list("nobody") == []

    def test_a_subscriber_is_added_once_unless_replaced(self, store: DaemonStore) -> None:
        assert store.add(THREE)
        with pytest.raises(SubscriberError):
            store.add(THREE)
        before = store.list("three")[0]
        moved = Subscriber("three", topic="elsewhere", value_format=ValueFormat.JSON, parts=3)
        assert not store.add(moved, replace=True)
        after = store.list("three")[0]
        assert after.subscriber.topic == "elsewhere"
        assert after.subscriber_id == before.subscriber_id
        # Busy workers reload the definition at their next checkpoint write.
        assert all(b.version != a.version for b, a in zip(before.parts, after.parts, strict=True))

    def test_a_subscribers_part_count_is_fixed(self, store: DaemonStore) -> None:
        store.add(THREE)
        more = Subscriber("three", topic="three", value_format=ValueFormat.JSON, parts=4)
        with pytest.raises(SubscriberError):
            store.add(more, replace=True)
        assert len(store.list("three")[0].parts) == 3

    def test_a_subscriber_that_collides_with_another_is_refused(self, store: DaemonStore) -> None:
        store.add(ONE)
        with pytest.raises(SubscriberError, match="collides"):
            store.add(Subscriber("other", topic="one", value_format=ValueFormat.JSON))
        assert [s.subscriber.name for s in store.list()] == ["one"]

    def test_a_subscriber_started_now_skips_what_is_written(
        self, store: DaemonStore, write: Write
    ) -> None:
        write("old")
        store.add(ONE, StartFrom.NOW)
        store.add(THREE)
        new = write("new")
        start = store.list("one")[0].checkpoint
        assert [e.message_id for e in store.fetch(start, Selection(10)).events] == [new]
        assert store.list("three")[0].checkpoint == Position(0, 0)

    def test_every_event_belongs_to_exactly_one_part(
        self, store: DaemonStore, write: Write
    ) -> None:
        written = {write(f"order-{n}") for n in range(24)}
        fetched = [
            [e.message_id for e in store.fetch(Position(0, 0), Selection(100, part=p, parts=3)).events]
            for p in range(3)
        ]  # fmt: skip
        every = [message_id for ids in fetched for message_id in ids]
        assert sorted(every) == sorted(written), "each once, in one part"
        assert sum(1 for ids in fetched if ids) > 1, "the events spread over the parts"

    # -- retention ---------------------------------------------------------------------

    def test_retention_prunes_what_every_part_published_and_nothing_else(
        self, store: DaemonStore, write: Write
    ) -> None:
        write("a")
        write("b")
        first, second = store.fetch(Position(0, 0), Selection(10)).events
        store.add(ONE)
        store.add(Subscriber("two", topic="two", value_format=ValueFormat.JSON))
        me = store.open_session("a", 1, 60)
        for name, to in (("one", second.key), ("two", first.key)):
            assert store.claim(name, 0, me)
            store.advance(store.get_part(name, 0), to, me)
        assert sum(store.prune(3600)) == 0, "too young to prune"
        assert sum(store.prune(0)) == 1, "only what both subscribers published"
        left = store.fetch(Position(0, 0), Selection(10)).events
        assert [e.message_id for e in left] == [second.message_id]

    def test_retention_keeps_a_dead_letters_event_until_the_operator_prunes_it(
        self, store: DaemonStore, write: Write
    ) -> None:
        """Issue #47: `dead-letters redrive` publishes a dead letter's event from the
        outbox, so retention keeps it (it was pruned like any published row), and the
        dead letter itself, until the operator says otherwise."""
        write("a")
        write("b")
        _, second = store.fetch(Position(0, 0), Selection(10)).events
        store.add(ONE)
        me = store.open_session("a", 1, 60)
        assert store.claim("one", 0, me)
        letter = DeadLetter(second.key, second.message_id, DeadLetterDecision("dlq", "bad"))
        store.advance(store.get_part("one", 0), second.key, me, [letter])
        assert sum(store.prune(0)) == 1, "the dead letter's event stays"
        assert sum(store.prune_dead_letters()) == 0, "not redriven: kept"
        assert sum(store.prune_dead_letters("one", pending_older_than_s=3600)) == 0
        assert sum(store.prune_dead_letters("other", pending_older_than_s=0)) == 0
        assert [e.key for e in store.fetch(Position(0, 0), Selection(10)).events] == [second.key]
        assert sum(store.prune_dead_letters("one", pending_older_than_s=0)) == 1
        assert store.dead_letters("one", Position(0, 0), second.key) == {}
        assert sum(store.prune(0)) == 1
        assert store.fetch(Position(0, 0), Selection(10)).events == []

    def test_a_store_in_use_is_not_closed(self, store: DaemonStore) -> None:
        """The supervisor opens a new store when its one says it is closed."""
        assert not store.closed
