"""The contracts of what replay and verify read of the outbox and its ledger
(``relay.core.ports.ReplayLedger`` and ``VerifyOutbox``, issue #50), held against the
Postgres queries (``relay.adapters.postgres.replay_store``, ``verify_queries``) and the
in-memory ones (``relay.adapters.memory``). ``tests/unit/adapters/memory/`` and
``tests/integration/test_replay_ledger_contract.py`` subclass them once per adapter."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Protocol
from uuid import UUID

import pytest

from relay.core.interventions import Action, Actor, Intervention
from relay.core.model import Position
from relay.core.ports import PartState, ReplayLedger, SubscriberState, VerifyOutbox
from relay.core.replay import OpenReplay, ReplayRange
from relay.core.subscribers import StartFrom, Subscriber, ValueFormat
from relay.errors import SubscriberError

SUBSCRIBER = Subscriber("s", topic="t", value_format=ValueFormat.JSON)
ME = Actor("me", "here")


class LedgerStore(Protocol):
    """The store the contracts set the outbox up with, as an operator and a relay would."""

    def add(self, subscriber: Subscriber, start: StartFrom = StartFrom.BEGINNING) -> bool: ...

    def list(self, name: str | None = None) -> Sequence[SubscriberState]: ...

    def record(self, intervention: Intervention) -> int: ...

    def key_of(self, message_id: UUID) -> Position | None: ...

    def open_session(self, hostname: str, pid: int, timeout: float) -> UUID: ...

    def claim(self, name: str, part: int, owner: UUID) -> bool: ...

    def get_part(self, name: str, part: int) -> PartState: ...

    def advance(self, state: PartState, to: Position, owner: UUID) -> int: ...


# Commits one event (aggregate id, aggregate type, event type); returns its message id.
Write = Callable[[str, str, str], UUID]
# As many ledgers (or verify outboxes) on the store's outbox, each its own connection.
Ledgers = Callable[[int], list[ReplayLedger]]
Outboxes = Callable[[int], list[VerifyOutbox]]


def _key(store: LedgerStore, message_id: UUID) -> Position:
    key = store.key_of(message_id)
    assert key is not None
    return key


def _written(
    store: LedgerStore, write: Write, *events: tuple[str, str, str]
) -> tuple[list[UUID], list[Position]]:
    """Commit ``events`` (aggregate id, aggregate type, event type): their ids and keys."""
    ids = [write(*e) for e in events]
    return ids, [_key(store, m) for m in ids]


def _replay(subscriber_id: UUID, events: int | None = None, **params: object) -> Intervention:
    """A ledger entry of a replay of subscriber "s", as ``subscribers replay`` records it."""
    return Intervention(Action.REPLAY, "s", subscriber_id, ME, dict(params), events)


class ReplayLedgerContract:
    """Subclassed once per adapter, with ``store``, ``write`` and ``ledgers`` fixtures."""

    @pytest.fixture
    def subscriber_id(self, store: LedgerStore) -> UUID:
        store.add(SUBSCRIBER)
        return store.list("s")[0].subscriber_id

    def test_counts_and_lists_the_events_of_a_range_its_filters_take(
        self, store: LedgerStore, write: Write, ledgers: Ledgers
    ) -> None:
        ids, keys = _written(
            store, write, ("k", "order", "Placed"), ("k", "order", "Paid"), ("k", "user", "Placed"),
            ("k", "order", "Placed"),
        )  # fmt: skip
        [ledger] = ledgers(1)
        everything = ReplayRange(keys[0], keys[3])
        assert ledger.count(everything) == 4
        listed = sorted(ledger.events(everything), key=lambda e: e[1])
        assert [e[0] for e in listed] == ids
        narrowed = ReplayRange(
            keys[1],
            keys[3],
            aggregate_types=frozenset({"order"}),
            event_types=frozenset({"Placed"}),
        )
        assert ledger.count(narrowed) == 1
        assert ledger.events(narrowed) == [(ids[3], keys[3], "order", "Placed")]

    def test_finds_a_replay_on_the_ledger_until_it_is_done(
        self, store: LedgerStore, subscriber_id: UUID, ledgers: Ledgers
    ) -> None:
        wanted = ReplayRange(Position(1, 1), Position(5, 1), "into")
        entry = store.record(_replay(subscriber_id, 3, replay="start", args=wanted.args()))
        store.record(_replay(subscriber_id, replay="resume", of=entry))
        [ledger] = ledgers(1)
        running = OpenReplay(entry, wanted, 3, done=False)
        assert ledger.replays(subscriber_id) == [running]
        assert ledger.open(subscriber_id, wanted) == running
        assert ledger.open(subscriber_id, ReplayRange(Position(1, 1), Position(6, 1))) is None
        store.record(_replay(subscriber_id, replay="done", of=entry, published=3))
        assert ledger.replays(subscriber_id) == [OpenReplay(entry, wanted, 3, done=True)]
        assert ledger.open(subscriber_id, wanted) is None
        assert ledger.replays(uuid.uuid4()) == []

    def test_one_replay_of_a_subscriber_runs_at_a_time(
        self, subscriber_id: UUID, ledgers: Ledgers
    ) -> None:
        first, second = ledgers(2)
        with first.exclusive("s", subscriber_id):
            with pytest.raises(SubscriberError), second.exclusive("s", subscriber_id):
                pass
            with second.exclusive("other", uuid.uuid4()):  # another subscriber's: free
                pass
        with second.exclusive("s", subscriber_id):  # released
            pass


class VerifyOutboxContract:
    """Subclassed once per adapter, with ``store``, ``write`` and ``outboxes`` fixtures."""

    @pytest.fixture
    def owner(self, store: LedgerStore) -> UUID:
        return store.open_session("contract", 1, 60)  # only a session claims a part

    def _advance(self, store: LedgerStore, owner: UUID, name: str, to: Position) -> None:
        assert store.claim(name, 0, owner)
        store.advance(store.get_part(name, 0), to, owner)

    def test_a_parts_published_events_are_those_its_filters_take_up_to_its_checkpoint(
        self, store: LedgerStore, write: Write, outboxes: Outboxes, owner: UUID
    ) -> None:
        placed_only = Subscriber(
            "s", topic="t", value_format=ValueFormat.JSON, event_types=frozenset({"Placed"})
        )
        store.add(placed_only)
        ids, keys = _written(
            store, write, ("k1", "order", "Placed"), ("k1", "order", "Paid"),
            ("k2", "order", "Placed"), ("k3", "order", "Placed"),
        )  # fmt: skip
        self._advance(store, owner, "s", keys[2])
        [outbox] = outboxes(1)
        published = sorted(outbox.published_events(placed_only), key=lambda e: e.key)
        assert [(e.message_id, e.key, e.part) for e in published] == [
            (ids[0], keys[0], 0),
            (ids[2], keys[2], 0),
        ]
        assert not any(e.dead_lettered or e.redriven for e in published)
        assert [(e.aggregate_type, e.event_type) for e in published] == [("order", "Placed")] * 2
        assert outbox.placed("s", [ids[1], ids[3], uuid.uuid4()]) == {
            ids[1]: "filtered",
            ids[3]: "ahead",
        }
        assert outbox.part_starts("s") == []

    def test_a_part_created_now_starts_after_the_events_before_it(
        self, store: LedgerStore, write: Write, outboxes: Outboxes, owner: UUID
    ) -> None:
        before = write("k", "order", "Placed")
        store.add(SUBSCRIBER, StartFrom.NOW)
        after = write("k", "order", "Placed")
        self._advance(store, owner, "s", _key(store, after))
        [outbox] = outboxes(1)
        [(part, start)] = outbox.part_starts("s")
        assert part == 0 and _key(store, before) < start
        assert [e.message_id for e in outbox.published_events(SUBSCRIBER)] == [after]
        assert outbox.placed("s", [before]) == {before: "before_start"}
