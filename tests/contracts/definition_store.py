"""The contract of a definition's store (``relay.core.ports.DefinitionStore``): what
``subscribers add``/``set`` and a relay's start-up write (``add_all``, ``replace``,
``index_parts``) and the lag and skips they and ``status`` read of a subscriber's parts
(``lag_sample``, ``part_skips``), held against the Postgres store
(``relay.adapters.postgres.store.OutboxStore``) and the in-memory one
(``relay.adapters.memory.InMemoryDefinitions``). ``tests/unit/adapters/memory/`` and
``tests/integration/test_definition_store_contract.py`` subclass it once per adapter;
the interventions' part of the port has its own contract (``intervention_store.py``).

Positions differ between the adapters: the contract compares them with each other,
never with a number."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from uuid import UUID

import pytest

from relay.core.interventions import Action, Actor, Intervention
from relay.core.model import Position
from relay.core.ports import DefinitionStore, PartSkips
from relay.core.subscribers import StartFrom, Subscriber, ValueFormat
from relay.errors import SubscriberError
from tests.contracts.intervention_store import ONE, ONE_ORDERS, ORDERS, Relay, Write

OTHER = Subscriber("b", topic="u", value_format=ValueFormat.JSON)
# Publishes what ONE does to ONE's topic: refused beside it.
COLLIDING = Subscriber("c", topic="t", value_format=ValueFormat.JSON)

# Moves a part's checkpoint by hand (as an older version's reset could have left it):
# (subscriber, part, where); its updated_at becomes now.
Force = Callable[[str, int, Position], None]


def _entry(action: Action) -> Intervention:
    return Intervention(action, "s", None, Actor("me", "here"), {})


class DefinitionStoreContract:
    """Subclassed once per adapter, with ``store``, ``relay``, ``write`` and ``force``
    fixtures (``relay`` and ``write`` as the interventions' contract has them)."""

    @pytest.fixture
    def owner(self, relay: Relay) -> UUID:
        return relay.open_session("contract", 1, 60)  # only a session claims a part

    def _advance(self, relay: Relay, owner: UUID, to: Position) -> None:
        if relay.get_part("s", 0).owner != owner:
            assert relay.claim("s", 0, owner)
        relay.advance(relay.get_part("s", 0), to, owner)

    def _keys(self, store: DefinitionStore, ids: list[UUID]) -> list[Position]:
        keys = [t.key for t in store.skip_targets("s", ids)]
        assert None not in keys
        return [k for k in keys if k is not None]

    def test_add_all_creates_the_new_and_defines_the_stored_anew_keeping_checkpoints(
        self, store: DefinitionStore, relay: Relay, write: Write, owner: UUID
    ) -> None:
        store.add(ONE)
        ids = [write("k", "order") for _ in range(2)]
        first, last = self._keys(store, ids)
        self._advance(relay, owner, first)
        store.add_all([(ONE_ORDERS, StartFrom.NOW), (OTHER, StartFrom.NOW)])
        s, b = store.get("s"), store.get("b")
        assert s.subscriber == ONE_ORDERS
        assert [p.checkpoint for p in s.parts] == [first]  # a start is for new ones only
        assert b.subscriber == OTHER and b.parts[0].checkpoint > last

    def test_add_all_writes_all_or_none(self, store: DefinitionStore) -> None:
        store.add(ONE)
        with pytest.raises(SubscriberError, match="collides"):
            store.add_all([(OTHER, StartFrom.BEGINNING), (COLLIDING, StartFrom.BEGINNING)])
        with pytest.raises(SubscriberError, match="part count"):
            store.add_all([(OTHER, StartFrom.BEGINNING), (ORDERS, StartFrom.BEGINNING)])
        assert [s.subscriber for s in store.list()] == [ONE]

    def test_replace_writes_over_the_definition_it_was_computed_from_only(
        self, store: DefinitionStore
    ) -> None:
        store.add(ONE)
        store.set_paused("s", True)
        store.replace(ONE, ONE_ORDERS)  # its pause aside: stays paused
        assert store.get("s").subscriber == dataclasses.replace(ONE_ORDERS, paused=True)
        with pytest.raises(SubscriberError, match="changed by someone else"):
            store.replace(ONE, ONE)  # computed from a definition changed meanwhile
        assert store.get("s").subscriber.aggregate_types == frozenset({"order"})
        with pytest.raises(SubscriberError, match="no subscriber named 'b'"):
            store.replace(OTHER, OTHER)

    def test_index_parts_changes_no_definition_and_may_run_again(
        self, store: DefinitionStore
    ) -> None:
        store.add(ORDERS)
        before = store.list()
        store.index_parts()
        store.index_parts()
        assert [(s.subscriber, s.parts) for s in store.list()] == [
            (s.subscriber, s.parts) for s in before
        ]

    def test_a_lag_sample_scans_the_rows_after_the_checkpoint_counting_the_parts(
        self, store: DefinitionStore, relay: Relay, write: Write, owner: UUID
    ) -> None:
        store.add(ONE_ORDERS)
        kinds = ["order", "order", "invoice", "order", "invoice"]
        keys = self._keys(store, [write(str(n), kind) for n, kind in enumerate(kinds)])
        sample = store.lag_sample(store.get("s").parts[0], 100)
        assert (sample.scanned, sample.counted) == (5, 3)
        assert sample.first_position is not None and sample.last_position is not None
        assert sample.last_position - sample.first_position == 4  # one row each
        assert sample.age_s is not None and 0 <= sample.age_s < 600
        self._advance(relay, owner, keys[1])
        part = store.get("s").parts[0]
        assert store.lag_sample(part, 100)[:2] == (3, 1)
        scanned = store.lag_sample(part, 1)  # the invoice only: none of the part's
        assert (scanned.scanned, scanned.counted, scanned.age_s) == (1, 0, None)
        assert scanned.last_position == sample.last_position
        self._advance(relay, owner, keys[-1])
        caught_up = store.lag_sample(store.get("s").parts[0], 100)
        assert caught_up[:3] == (0, 0, None) and caught_up.age_s is None

    def test_part_skips_count_each_parts_resets_and_skips_from_the_ledger(
        self, store: DefinitionStore, write: Write
    ) -> None:
        store.add(ONE)
        ids = [write(str(n), "order") for n in range(4)]
        assert store.part_skips("s", None) == [PartSkips(0, False, None, None, 0, 0)]
        store.skip("s", [ids[1]], _entry(Action.SKIP))
        store.reset("s", StartFrom.NOW, _entry(Action.RESET))
        assert store.part_skips("s", None) == [PartSkips(0, False, None, None, 3, 1)]
        store.add(dataclasses.replace(ORDERS, name="b", topic="u"))
        assert [p.part for p in store.part_skips("b", 10)] == [0, 1, 2]

    def test_a_checkpoint_beyond_the_horizon_counts_the_rows_written_since(
        self, store: DefinitionStore, write: Write, force: Force
    ) -> None:
        store.add(ONE_ORDERS)
        keys = self._keys(store, [write("a", "order"), write("b", "order")])
        force("s", 0, Position(keys[-1].transaction_id + 1_000, 0))
        write("c", "invoice")
        write("d", "order")  # after the checkpoint was set: jumped over
        assert store.part_skips("s", None) == [PartSkips(0, True, 4, 1, 0, 0)]
        assert store.part_skips("s", 2) == [PartSkips(0, True, 2, 1, 0, 0)]
