"""Issue #48: how a subscriber's definition is written, as the relay role writes it. A
change computed from a definition someone changed meanwhile is refused; the relay's
start-up writes its config's subscribers all or none."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import PoisonPolicy, StartFrom, Subscriber, ValueFormat
from relay.errors import SubscriberError

FILTERED = Subscriber("s", topic="s", value_format=ValueFormat.JSON,
                      aggregate_types=frozenset({"order"}))  # fmt: skip


def _stored(store: OutboxStore) -> dict[str, Subscriber]:
    return {s.subscriber.name: s.subscriber for s in store.list()}


def test_a_change_computed_from_a_definition_changed_meanwhile_is_refused(
    relay_db: psycopg.Connection[Any],
) -> None:
    store = OutboxStore(relay_db)
    store.add(FILTERED)
    seen = store.get("s").subscriber
    # Someone else changes it (another operator's `subscribers set`)...
    store.replace(seen, dataclasses.replace(seen, topic="elsewhere"))
    # ...so a change computed from what was seen before would undo theirs.
    mine = dataclasses.replace(seen, on_poison=PoisonPolicy.DEAD_LETTER)
    with pytest.raises(SubscriberError, match="changed by someone else meanwhile"):
        store.replace(seen, mine)
    assert _stored(store)["s"] == dataclasses.replace(seen, topic="elsewhere")
    # A pause meanwhile is no definition's change: it stays, the change applies.
    store.set_paused("s", True)
    now = store.get("s").subscriber
    store.replace(
        dataclasses.replace(now, paused=False), dataclasses.replace(now, key="{message_id}")
    )
    assert _stored(store)["s"] == dataclasses.replace(now, key="{message_id}", paused=True)


def test_subscribers_written_together_are_written_all_or_none(
    relay_db: psycopg.Connection[Any],
) -> None:
    store = OutboxStore(relay_db)
    store.add(FILTERED)
    first = Subscriber("a", topic="a", value_format=ValueFormat.JSON)
    changed = dataclasses.replace(FILTERED, topic="changed")
    clashing = Subscriber("b", topic="a", value_format=ValueFormat.JSON)  # a's topic

    with pytest.raises(SubscriberError, match="collides with 'a'"):
        store.add_all([(first, StartFrom.BEGINNING), (changed, StartFrom.BEGINNING),
                       (clashing, StartFrom.BEGINNING)])  # fmt: skip

    assert _stored(store) == {"s": FILTERED}
    store.add_all([(first, StartFrom.NOW), (changed, StartFrom.BEGINNING)])
    assert _stored(store) == {"a": first, "s": changed}
