"""The store port's contract (``relay.core.ports.PartStore``): what a part worker relies on
of the outbox, held against the Postgres store and the in-memory one alike, so tests
of the worker's logic over the in-memory store say something about the real one.
``tests/unit/adapters/memory/test_store_contract.py`` and ``tests/integration/test_store_contract.py``
subclass it once per adapter."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol
from uuid import UUID

import pytest

from relay.core.interventions import Action, Actor, Intervention
from relay.core.model import OutboxEvent, Position, Unreadable
from relay.core.ports import DeadLetter, DeadLetterDecision, Fetched, PartStore, Selection
from relay.core.subscribers import Subscriber, ValueFormat
from relay.errors import CheckpointConflict, ClaimLost, SubscriberError

SUBSCRIBER = Subscriber("s", topic="t", value_format=ValueFormat.JSON)


class AdminStore(PartStore, Protocol):
    """The port, plus what an operator does around a worker."""

    def add(self, subscriber: Subscriber) -> bool: ...

    def claim(self, name: str, part: int, owner: UUID) -> bool: ...

    def skip(self, name: str, message_ids: Sequence[UUID], record: Intervention) -> list[int]: ...


def skipping(*message_ids: UUID) -> Intervention:
    """The ledger entry of a skip of these events of subscriber "s"."""
    ids = [str(m) for m in message_ids]
    return Intervention(Action.SKIP, "s", None, Actor("me", "here"), {"events": ids}, len(ids))


# Commits one event for the given aggregate id; returns its message id.
Write = Callable[[str], UUID]


class StoreContract:
    """Subclassed once per adapter, with ``store`` and ``write`` fixtures."""

    @pytest.fixture
    def owner(self, store: AdminStore, session: UUID) -> UUID:
        owner = session
        store.add(SUBSCRIBER)
        assert store.claim("s", 0, owner)
        return owner

    @pytest.fixture
    def committed(self, store: AdminStore, write: Write) -> OutboxEvent:
        """One event, committed and fetched."""
        write("k")
        [event] = store.fetch(Position(0, 0), Selection(10)).events
        return event

    def test_fetch_returns_the_events_after_a_position_in_commit_order(
        self, store: AdminStore, write: Write
    ) -> None:
        ids = [write(f"k{n}") for n in range(4)]
        everything = store.fetch(Position(0, 0), Selection(10)).events
        assert [e.message_id for e in everything] == ids
        assert [e.aggregate_id for e in everything] == ["k0", "k1", "k2", "k3"]
        after_second = store.fetch(everything[1].key, Selection(10)).events
        assert [e.message_id for e in after_second] == ids[2:]
        assert store.fetch(everything[-1].key, Selection(10)) == Fetched([], None)

    def test_a_fetch_for_a_pass_through_gives_each_payload_as_its_json_text(
        self, store: AdminStore, committed: OutboxEvent
    ) -> None:
        """What a json subscriber that passes payloads through publishes (issue #53)."""
        [raw] = store.fetch(Position(0, 0), Selection(10, raw_payloads=True)).events
        assert type(raw.payload) is bytes
        assert json.loads(raw.payload) == committed.payload
        assert raw._replace(payload=committed.payload) == committed

    def test_fetch_stops_at_the_limit_and_returns_one_event_past_the_byte_cap(
        self, store: AdminStore, write: Write
    ) -> None:
        ids = [write("k") for _ in range(3)]
        assert [e.message_id for e in store.fetch(Position(0, 0), Selection(2)).events] == ids[:2]
        # Even an event bigger than the cap is fetched: it has to be published some time.
        capped = store.fetch(Position(0, 0), Selection(10, max_bytes=1))
        assert [e.message_id for e in capped.events] == ids[:1] and capped.full

    def test_a_filtered_fetch_leaves_out_what_the_filter_drops_and_reads_past_it(
        self, store: AdminStore, write: Write
    ) -> None:
        """Rows a subscriber drops never leave Postgres, but the read goes past them, so
        its checkpoint does too; a fetch from there finds nothing new."""
        ids = [write(f"k{n}") for n in range(3)]
        kept = store.fetch(Position(0, 0), Selection(10, aggregate_types=frozenset({"order"})))
        assert [e.message_id for e in kept.events] == ids and not kept.full
        assert kept.read_to is not None and kept.read_to >= kept.events[-1].key
        dropped = store.fetch(Position(0, 0), Selection(10, aggregate_types=frozenset({"invoice"})))
        assert dropped.events == [] and dropped.read_to is not None
        assert dropped.read_to >= kept.events[-1].key
        assert store.fetch(
            dropped.read_to, Selection(10, aggregate_types=frozenset({"invoice"}))
        ) == (Fetched([], None))
        by_event = store.fetch(Position(0, 0), Selection(2, event_types=frozenset({"Shipped"})))
        assert by_event == Fetched([], kept.events[1].key, True)

    @pytest.mark.parametrize(
        "filters",
        [{}, {"aggregate_types": frozenset({"order"})}, {"event_types": frozenset({"Placed"})}],
    )
    def test_a_row_too_large_for_any_record_comes_back_as_its_identity(
        self, store: AdminStore, write: Write, filters: dict[str, Any]
    ) -> None:
        """Issue #27: such a row is poison decided from its size; its content is not read."""
        small, big = write("k"), write("k" * 300)
        events = store.fetch(Position(0, 0), Selection(10, max_row_bytes=200, **filters)).events
        assert [e.message_id for e in events] == [small, big]
        assert events[0].payload == {"id": "k"}
        unread = events[1]
        assert isinstance(unread.payload, Unreadable) and not unread.payload.read
        assert "too large to publish" in str(unread.payload)
        assert unread.aggregate_id == "k" * 200 + "...[cut: 300 bytes]"
        assert unread.headers == {} and unread.event_type == "Placed"

    def test_a_part_is_stored_with_its_subscriber_and_owner(
        self, store: AdminStore, owner: UUID
    ) -> None:
        state = store.get_part("s", 0)
        assert (state.name, state.part, state.owner) == ("s", 0, owner)
        assert state.subscriber.topic == "t" and state.halted_error is None
        with pytest.raises(SubscriberError):
            store.get_part("nobody", 0)

    def test_a_part_claimed_by_one_owner_is_refused_to_another(
        self, store: AdminStore, owner: UUID
    ) -> None:
        assert not store.claim("s", 0, uuid.uuid4())
        assert store.get_part("s", 0).owner == owner

    # durable=False (transactional delivery's checkpoint) is the same compare-and-set.
    @pytest.mark.parametrize("durable", [True, False])
    def test_advance_moves_the_checkpoint_and_the_version(
        self, store: AdminStore, committed: OutboxEvent, owner: UUID, durable: bool
    ) -> None:
        state = store.get_part("s", 0)
        version = store.advance(state, committed.key, owner, durable=durable)
        stored = store.get_part("s", 0)
        assert stored.checkpoint == committed.key and stored.version == version > state.version
        assert store.fetch(stored.checkpoint, Selection(10)) == Fetched([], None)

    @pytest.mark.parametrize("durable", [True, False])
    def test_advance_from_a_stale_version_is_a_conflict(
        self, store: AdminStore, committed: OutboxEvent, owner: UUID, durable: bool
    ) -> None:
        stale = store.get_part("s", 0)
        store.advance(stale, committed.key, owner, durable=durable)
        with pytest.raises(CheckpointConflict):
            store.advance(stale, committed.key, owner, durable=durable)

    def test_advance_by_another_owner_is_a_conflict(
        self, store: AdminStore, committed: OutboxEvent, owner: UUID
    ) -> None:
        state = store.get_part("s", 0)
        with pytest.raises(CheckpointConflict):
            store.advance(state, committed.key, uuid.uuid4())
        assert store.get_part("s", 0).checkpoint == Position(0, 0)

    def test_advance_never_moves_a_checkpoint_back(
        self, store: AdminStore, committed: OutboxEvent, owner: UUID
    ) -> None:
        store.advance(store.get_part("s", 0), committed.key, owner)
        with pytest.raises(CheckpointConflict):
            store.advance(store.get_part("s", 0), Position(0, 0), owner)
        assert store.get_part("s", 0).checkpoint == committed.key

    def test_a_dead_letter_decision_is_found_in_its_range_only(
        self, store: AdminStore, write: Write, owner: UUID
    ) -> None:
        write("k")
        write("k")
        first, second = store.fetch(Position(0, 0), Selection(10)).events
        decision = DeadLetterDecision("dlq", "too large")
        letter = DeadLetter(second.key, second.message_id, decision)
        store.advance(store.get_part("s", 0), second.key, owner, [letter])
        assert store.dead_letters("s", Position(0, 0), second.key) == {second.message_id: decision}
        assert store.dead_letters("s", Position(0, 0), first.key) == {}
        assert store.dead_letters("s", second.key, Position(2**62, 0)) == {}

    def test_a_dead_letter_decision_is_recorded_only_with_its_checkpoint(
        self, store: AdminStore, write: Write, owner: UUID
    ) -> None:
        """Issue #27: a decision recorded before its Kafka transaction committed stayed
        recorded when the transaction aborted: dead-lettered, but on no topic."""
        write("k")
        [event] = store.fetch(Position(0, 0), Selection(10)).events
        stale = store.get_part("s", 0)
        store.advance(stale, Position(0, 0), owner)  # moves the version on
        letter = DeadLetter(event.key, event.message_id, DeadLetterDecision("dlq", "too large"))
        with pytest.raises(CheckpointConflict):
            store.advance(stale, event.key, owner, [letter])
        assert store.dead_letters("s", Position(0, 0), event.key) == {}
        assert store.get_part("s", 0).checkpoint == Position(0, 0)

    def test_halt_records_the_error_on_the_part(self, store: AdminStore, owner: UUID) -> None:
        before = store.get_part("s", 0)
        store.halt(before, owner, "poison event")
        after = store.get_part("s", 0)
        assert after.halted_error == "poison event"
        # A running worker holding the old version notices at its next checkpoint.
        assert after.version != before.version

    def test_halt_by_an_owner_that_lost_the_part_is_refused(
        self, store: AdminStore, owner: UUID
    ) -> None:
        with pytest.raises(ClaimLost):
            store.halt(store.get_part("s", 0), uuid.uuid4(), "poison event")
        assert store.get_part("s", 0).halted_error is None

    def test_a_skipped_event_comes_with_its_parts_state_until_the_checkpoint_passes_it(
        self, store: AdminStore, write: Write, owner: UUID
    ) -> None:
        """Issue #48: the worker drops what it finds there (`subscribers skip`)."""
        first, second = write("k"), write("k")
        assert store.get_part("s", 0).skips == frozenset()
        assert store.skip("s", [second], skipping(second)) == []
        state = store.get_part("s", 0)
        assert state.skips == {second}
        key = store.key_of(second)
        assert key is not None
        store.advance(state, key, owner)
        assert store.get_part("s", 0).skips == frozenset(), "passed: no longer pending"
        assert store.key_of(first) is not None

    def test_skipping_the_event_a_part_halted_on_resumes_it(
        self, store: AdminStore, write: Write, owner: UUID
    ) -> None:
        poison, other = write("k"), write("k")
        store.halt(store.get_part("s", 0), owner, "poison event", poison)
        assert store.skip("s", [other], skipping(other)) == []
        assert store.get_part("s", 0).halted_error == "poison event", "halted on another"
        assert store.skip("s", [poison], skipping(poison)) == [0]
        resumed = store.get_part("s", 0)
        assert resumed.halted_error is None and resumed.skips == {poison, other}

    def test_a_skip_of_an_event_published_or_skipped_already_is_refused(
        self, store: AdminStore, write: Write, owner: UUID
    ) -> None:
        published, pending = write("k"), write("k")
        key = store.key_of(published)
        assert key is not None
        store.advance(store.get_part("s", 0), key, owner)
        before = store.get_part("s", 0)
        for refused in ([published], [pending, published], [uuid.uuid4()]):
            with pytest.raises(SubscriberError):
                store.skip("s", refused, skipping(*refused))
        assert store.get_part("s", 0) == before, "nothing changed"
        store.skip("s", [pending], skipping(pending))
        with pytest.raises(SubscriberError):
            store.skip("s", [pending], skipping(pending))

    def test_key_of_finds_an_event_in_the_outbox_only(
        self, store: AdminStore, committed: OutboxEvent
    ) -> None:
        assert store.key_of(committed.message_id) == committed.key
        assert store.key_of(uuid.uuid4()) is None

    def test_the_key_space_checked_is_the_one_stored(self, store: AdminStore) -> None:
        check = store.check_key_space()
        assert check is not None and check.key_space == store.key_space().id


def event(aggregate_id: str) -> OutboxEvent:
    """An event as an application writes it; the store gives it its key."""
    return OutboxEvent(
        transaction_id=0,
        position=0,
        message_id=uuid.uuid4(),
        aggregate_type="order",
        aggregate_id=aggregate_id,
        aggregate_version=None,
        event_type="Placed",
        payload={"id": aggregate_id},
        headers={},
        occurred_at=datetime.now(UTC),
    )
