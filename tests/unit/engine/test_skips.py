"""Issue #48: the part worker skips exactly the events the operator skipped
(`subscribers skip`), over the in-memory store and publisher: a halted part resumes and
publishes every other event of the poison one's batch; a skip made while a batch travels
reaches the batch read meanwhile too. And the halt says how to skip the event alone."""

from __future__ import annotations

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.interventions import Action, Actor, Intervention
from relay.core.model import OutboxEvent, Position
from relay.core.subscribers import Subscriber, ValueFormat
from tests.unit.engine.test_worker_logic import (
    claimed,
    event,
    ids,
    published_ids,
    run_until_halted,
    run_until_published,
    worker,
)

ROUTED = Subscriber("s", topic="{aggregate_type}", value_format=ValueFormat.JSON)


def skip(store: InMemoryStore, *events: OutboxEvent) -> list[int]:
    record = Intervention(Action.SKIP, "s", None, Actor("me", "here"), {}, len(events))
    return store.skip("s", [e.message_id for e in events], record)


def test_a_halt_names_the_poison_event_the_skip_command_and_what_a_reset_would_skip() -> None:
    store = claimed(ROUTED)
    k1, k2 = store.append(event(1, "t")), store.append(event(2, "t"))
    k3 = store.append(event(3, "no topic!"))  # an illegal topic name
    store.append(event(4, "t"))
    run_until_halted(worker(store, InMemoryPublisher()), store)
    halted = store.get_part("s", 0).halted_error or ""
    assert f"poison event {k3.message_id} at {k3.key}" in halted
    assert f"`outbox-relay subscribers skip s --event {k3.message_id}`" in halted
    assert f"a reset to {k3.key} would skip 3 event(s) of this part, 2 of them before" in halted
    assert store.halted_on["s", 0] == k3.message_id
    assert store.get_part("s", 0).checkpoint < k1.key < k2.key


def test_skipping_the_poison_event_resumes_the_part_and_publishes_every_other_one() -> None:
    store = claimed(ROUTED)
    k1, k2 = store.append(event(1, "t")), store.append(event(2, "t"))
    k3 = store.append(event(3, "no topic!"))
    k4 = store.append(event(4, "t"))
    run_until_halted(worker(store, InMemoryPublisher()), store)
    assert skip(store, k3) == [0]
    kafka = InMemoryPublisher()
    w = worker(store, kafka)
    run_until_published(w, store)
    assert published_ids(kafka) == ids([k1, k2, k4])
    assert len(kafka.transactions) == 1, "the skip passes with its batch, in its commit"
    assert store.get_part("s", 0).checkpoint == k4.key and w.stats.errors == 0


def test_a_skip_made_while_a_batch_travels_reaches_the_batch_read_meanwhile() -> None:
    """The skip bumps the part's version: the worker reloads its skips when it records
    the batch in flight, and reads again what it had read ahead with the old ones."""
    store = claimed()
    written = [store.append(event(n)) for n in range(1, 5)]
    kafka = InMemoryPublisher()

    def operator_skips_the_third() -> None:
        if not kafka.transactions:
            skip(store, written[2])

    kafka.on_send = operator_skips_the_third
    run_until_published(worker(store, kafka, batch_size=2), store)
    assert published_ids(kafka) == ids([written[0], written[1], written[3]])


def test_a_batch_of_skipped_events_only_moves_the_checkpoint() -> None:
    store = claimed()
    first, second = store.append(event(1)), store.append(event(2))
    skip(store, first, second)
    kafka = InMemoryPublisher()
    run_until_published(worker(store, kafka), store)
    assert kafka.transactions == []
    assert store.get_part("s", 0).checkpoint == second.key > Position(0, 0)
