"""The contract of the operators' interventions' store (``relay.core.ports.InterventionStore``,
issue #50): resets, skips, pause and resume, and the ledger they leave, held against the
Postgres store (``relay.adapters.postgres.intervention_queries``) and the in-memory one
(``relay.adapters.memory.InMemoryInterventions``). ``tests/unit/adapters/memory/`` and
``tests/integration/test_intervention_store_contract.py`` subclass it once per adapter.

Which part an event falls in is each adapter's own hash: the contract asks the store
(``skip_targets``) rather than computing it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Protocol
from uuid import UUID

import pytest

from relay.core.interventions import Action, Actor, Intervention, PartMove, SkipTarget
from relay.core.model import Position
from relay.core.ports import InterventionStore, PartState
from relay.core.subscribers import StartFrom, Subscriber, ValueFormat
from relay.errors import SubscriberError

ORDERS = Subscriber(
    "s", topic="t", value_format=ValueFormat.JSON, parts=3, aggregate_types=frozenset({"order"})
)
ONE = Subscriber("s", topic="t", value_format=ValueFormat.JSON)
ONE_ORDERS = Subscriber(
    "s", topic="t", value_format=ValueFormat.JSON, aggregate_types=frozenset({"order"})
)
ME = Actor("me", "here")


class Relay(Protocol):
    """What a relay does to the parts the contracts set up: claims, advances, halts."""

    def open_session(self, hostname: str, pid: int, timeout: float) -> UUID: ...

    def claim(self, name: str, part: int, owner: UUID) -> bool: ...

    def get_part(self, name: str, part: int) -> PartState: ...

    def advance(self, state: PartState, to: Position, owner: UUID) -> int: ...

    def halt(
        self, state: PartState, owner: UUID, error: str, message_id: UUID | None = None
    ) -> None: ...


# Commits one event (aggregate id, aggregate type); returns its message id.
Write = Callable[[str, str], UUID]


def _entry(action: Action, **params: object) -> Intervention:
    return Intervention(action, "s", None, ME, dict(params))


def _targets(store: InterventionStore, ids: list[UUID]) -> list[SkipTarget]:
    return store.skip_targets("s", ids)


class InterventionStoreContract:
    """Subclassed once per adapter, with ``store``, ``relay`` and ``write`` fixtures."""

    @pytest.fixture
    def owner(self, relay: Relay) -> UUID:
        return relay.open_session("contract", 1, 60)  # only a session claims a part

    def _advance(self, relay: Relay, owner: UUID, part: int, to: Position) -> None:
        assert relay.claim("s", part, owner)
        relay.advance(relay.get_part("s", part), to, owner)

    def test_a_reset_to_a_position_moves_each_part_from_its_own_checkpoint(
        self, store: InterventionStore, relay: Relay, write: Write, owner: UUID
    ) -> None:
        store.add(ORDERS)
        ids = [write(str(n), "invoice" if n % 4 == 0 else "order") for n in range(16)]
        targets = _targets(store, ids)
        for part, at in ((0, 3), (1, 10)):  # part 2 stays at the beginning
            self._advance(relay, owner, part, targets[at].key or Position(0, 0))
        target = targets[7].key
        assert target is not None
        checkpoints = {p.part: p.checkpoint for p in store.get("s").parts}

        def expected(part: int) -> int:
            low, high = sorted((checkpoints[part], target))
            return sum(
                1
                for t in targets
                if t.part == part and t.aggregate_type == "order" and t.key and low < t.key <= high
            )

        previewed = store.moves(store.get("s"), target)
        assert previewed == [PartMove(p, checkpoints[p], target, expected(p)) for p in range(3)]
        assert store.reset("s", target, _entry(Action.RESET, to=str(target))) == previewed
        state = store.get("s")
        assert [p.checkpoint for p in state.parts] == [target] * 3
        [reset] = store.ledger("s")
        assert reset.action is Action.RESET and reset.events == sum(map(expected, range(3)))
        assert reset.params == {"to": str(target), "parts": [m.as_dict() for m in previewed]}
        ranges = [
            (k.part, k.events, k.after, k.upto) for k in store.operator_skips(state.subscriber_id)
        ]
        assert ranges == [
            (m.part, m.events, m.before, m.after) for m in previewed if m.skips and m.events
        ]

    def test_a_reset_to_the_beginning_or_now_and_one_refused(
        self, store: InterventionStore, write: Write
    ) -> None:
        store.add(ONE)
        ids = [write("k", "order") for _ in range(3)]
        last = _targets(store, ids)[-1].key
        assert last is not None
        now = store.reset_target("s", StartFrom.NOW)
        assert now > last and now.position == 0
        [forward] = store.reset("s", StartFrom.NOW)
        assert (forward.before, forward.after, forward.events) == (Position(0, 0), now, 3)
        [back] = store.reset("s", StartFrom.BEGINNING)
        assert (back.before, back.after, back.events, back.skips) == (now, Position(0, 0), 3, False)
        assert store.reset_target("s", last) == last
        with pytest.raises(SubscriberError, match="horizon"):
            store.reset("s", Position(2**62, 0))
        with pytest.raises(SubscriberError):
            store.reset("nobody", StartFrom.NOW)
        assert store.get("s").parts[0].checkpoint == Position(0, 0), "a refusal moves nothing"
        assert store.ledger("s") == []  # none of these recorded one

    def test_skip_targets_tell_why_an_event_cannot_be_skipped(
        self, store: InterventionStore, relay: Relay, write: Write, owner: UUID
    ) -> None:
        store.add(ONE_ORDERS)
        published, pending, other, skipped = (
            write("a", "order"), write("b", "order"), write("c", "user"), write("d", "order"),
        )  # fmt: skip
        self._advance(relay, owner, 0, _targets(store, [published])[0].key or Position(0, 0))
        store.skip("s", [skipped], _entry(Action.SKIP))
        unknown = uuid.uuid4()
        ids = [published, pending, other, skipped, unknown]
        targets = _targets(store, ids)
        assert [t.message_id for t in targets] == ids
        assert [t.refusal("s") is None for t in targets] == [False, True, False, False, False]
        assert [t.pending for t in targets] == [False, True, True, True, False]
        assert [t.matches for t in targets[:4]] == [True, True, False, True]
        entry = store.ledger("s")[0].id
        assert [t.skipped_by for t in targets] == [None, None, None, entry, None]
        assert targets[4].key is None and targets[4].aggregate_type is None
        assert [t.part for t in targets] == [0] * 5
        with pytest.raises(SubscriberError):
            store.skip_targets("nobody", ids)

    def test_a_skip_is_on_the_ledger_and_resumes_a_part_halted_on_it(
        self, store: InterventionStore, relay: Relay, write: Write, owner: UUID
    ) -> None:
        store.add(ONE)
        poison, after = write("a", "order"), write("b", "order")
        assert relay.claim("s", 0, owner)
        relay.halt(relay.get_part("s", 0), owner, "poison", poison)
        assert [t.halted_on_it for t in _targets(store, [poison, after])] == [True, False]
        version = store.get("s").parts[0].version
        assert store.skip("s", [poison], _entry(Action.SKIP, ids=[str(poison)])) == [0]
        [part] = store.get("s").parts
        assert part.halted_error is None and part.skips == frozenset({poison})
        assert part.version > version
        [entry] = store.ledger("s")
        assert (entry.action, entry.params, entry.os_user, entry.host) == (
            Action.SKIP, {"ids": [str(poison)]}, "me", "here",
        )  # fmt: skip
        assert entry.db_role and entry.recorded_at.tzinfo is not None
        [skip] = store.operator_skips(part.subscriber_id)
        assert (skip.entry, skip.part, skip.events, skip.message_id) == (entry, 0, 1, poison)
        with pytest.raises(SubscriberError, match="skipped already"):
            store.skip("s", [after, poison], _entry(Action.SKIP))
        assert len(store.ledger("s")) == 1 and store.get("s").parts[0].skips == {poison}
        assert store.skip("s", [after], _entry(Action.SKIP)) == []  # not halted on it

    def test_a_skipped_event_is_not_counted_again_by_a_reset(
        self, store: InterventionStore, write: Write
    ) -> None:
        store.add(ONE)
        ids = [write("k", "order") for _ in range(3)]
        store.skip("s", ids[1:2], _entry(Action.SKIP))
        [move] = store.reset("s", _targets(store, ids)[-1].key or Position(0, 0))
        assert move.events == 2

    def test_pause_and_resume_are_on_the_ledger_and_resume_clears_a_halt(
        self, store: InterventionStore, relay: Relay, owner: UUID
    ) -> None:
        store.add(ONE)
        assert relay.claim("s", 0, owner)
        relay.halt(relay.get_part("s", 0), owner, "broken")
        version = store.get("s").parts[0].version
        store.set_paused("s", True, _entry(Action.PAUSE))
        [part] = store.get("s").parts
        assert part.subscriber.paused and part.halted_error == "broken" and part.version > version
        store.set_paused("s", False, _entry(Action.RESUME))
        [part] = store.get("s").parts
        assert not part.subscriber.paused and part.halted_error is None
        assert [e.action for e in store.ledger("s")] == [Action.PAUSE, Action.RESUME]
        with pytest.raises(SubscriberError):
            store.set_paused("nobody", True, _entry(Action.PAUSE))
        assert len(store.ledger("s")) == 2

    def test_get_list_remove_and_a_transaction_undone(self, store: InterventionStore) -> None:
        with pytest.raises(SubscriberError):
            store.get("s")
        store.add(ONE)
        assert [s.subscriber.name for s in store.list()] == ["s"]
        assert (store.get("s").subscriber.topic, store.get("s").subscriber.parts) == ("t", 1)
        with pytest.raises(RuntimeError), store.transaction():
            store.record(_entry(Action.PAUSE))
            store.set_paused("s", True)
            raise RuntimeError("undone")
        assert store.ledger("s") == [] and not store.get("s").subscriber.paused
        first = store.record(_entry(Action.PAUSE))
        store.remove("s", _entry(Action.REMOVE))
        assert store.list("s") == []
        assert [(e.id, e.action) for e in store.ledger("s")] == [
            (first, Action.PAUSE), (first + 1, Action.REMOVE),
        ]  # fmt: skip
