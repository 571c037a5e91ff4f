"""Two subscribers may never publish one event to one topic (each would, and consumers
would see it twice), nor share a dead-letter topic."""

from __future__ import annotations

from typing import Any

import pytest

from relay.subscribers import Subscriber, collision


def s(name: str, **kwargs: Any) -> Subscriber:
    for key in ("aggregate_types", "event_types"):
        if key in kwargs:
            kwargs[key] = frozenset(kwargs[key])
    return Subscriber(name, **kwargs)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (s("default"), s("billing", aggregate_types={"order"})),  # the README's old example
        (s("a", topic="orders"), s("b", topic="{aggregate_type}")),
        (s("a", topic="orders", event_types={"Placed"}), s("b", topic="orders")),
        (s("a", topic="{aggregate_type}.{event_type}"), s("b", topic="order.{event_type}")),
        (
            s("a", topic="{aggregate_type}-x", aggregate_types={"o"}),
            s("b", topic="o-{event_type}", event_types={"x"}),
        ),
        (s("a", topic="x", dead_letter_topic="dl"), s("b", topic="y", dead_letter_topic="dl")),
    ],
)
def test_overlapping_subscribers_collide(a: Subscriber, b: Subscriber) -> None:
    assert collision(a, b) is not None
    assert collision(b, a) is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (s("a", aggregate_types={"order"}), s("b", aggregate_types={"invoice"})),
        (s("a"), s("b", topic="billing.{aggregate_type}")),
        (s("a", topic="orders"), s("b", topic="{aggregate_type}", aggregate_types={"invoice"})),
        (s("a", event_types={"A"}), s("b", event_types={"B"})),
        # A row routed into another's dead-letter topic is refused as it is routed.
        (s("a", topic="x.{aggregate_type}"), s("b", topic="y", dead_letter_topic="x.order")),
    ],
)
def test_disjoint_subscribers_do_not(a: Subscriber, b: Subscriber) -> None:
    assert collision(a, b) is None
    assert collision(b, a) is None
