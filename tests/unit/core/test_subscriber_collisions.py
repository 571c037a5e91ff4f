"""Two subscribers may never publish one event to one topic (each would, and consumers
would see it twice), nor share a dead-letter topic."""

from __future__ import annotations

from typing import Any

import pytest

from relay.core.subscribers import Subscriber, TopicGuard, collision


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


# -- rows routed into another subscriber's topics (TopicGuard) -------------------------


def test_a_row_cannot_reach_into_another_subscribers_templated_topics() -> None:
    billing = s("billing", topic="billing.{event_type}", aggregate_types={"invoice"})
    wild = s("wild", topic="{aggregate_type}")
    guard = TopicGuard("cp")
    guard.update([billing, wild])
    # A row of aggregate type "billing.InvoicePaid" would land among billing's topics.
    refusal = guard.refusal("billing.InvoicePaid", wild)
    assert refusal is not None and "'billing'" in refusal and "billing.{event_type}" in refusal
    assert guard.refusal("billing.InvoicePaid", billing) is None  # its own
    assert guard.refusal("orders", wild) is None
    assert guard.refusal("billing-InvoicePaid", wild) is None  # not one billing produces


def test_filters_narrow_what_a_template_claims_and_a_longer_template_is_not_shut_out() -> None:
    v1 = s("v1", topic="events.{aggregate_type}")
    v2 = s("v2", topic="events.{aggregate_type}.v2")
    shipped = s("shipped", topic="{event_type}.log", event_types={"Shipped"})
    other = s("other", topic="{aggregate_type}.log")
    guard = TopicGuard("cp")
    guard.update([v1, v2, shipped, other])
    # v1 produces "events.order.v2" only for a row whose type carries a ".": v2 keeps it.
    assert guard.refusal("events.order.v2", v2) is None
    assert "'v2'" in (guard.refusal("events.order.v2", v1) or "")
    assert guard.refusal("events.order", v1) is None
    # shipped claims "Shipped.log" only: its filter names the one event type it takes.
    assert "'shipped'" in (guard.refusal("Shipped.log", other) or "")
    assert guard.refusal("Placed.log", other) is None


@pytest.mark.parametrize(
    "topic",
    [
        "_schemas",
        "_confluent-metrics",
        "_confluent-command",
        "connect-offsets",
        "connect-configs",
        "connect-status",
    ],
)
def test_schema_registry_confluent_and_connect_topics_are_refused(topic: str) -> None:
    wild = s("wild", topic="{aggregate_type}")
    guard = TopicGuard("cp")
    guard.update([wild])
    refusal = guard.refusal(topic, wild)
    assert refusal is not None and "internal" in refusal


def test_only_a_field_no_filter_lists_leaves_the_topic_to_the_row() -> None:
    """Issue #47: a topic the operator declared (fixed, or one a filter names) is not a
    row's choice; a template field no filter lists is."""
    assert s("fixed", topic="audit").free_fields == frozenset()
    assert (
        s("named", topic="billing.{aggregate_type}", aggregate_types={"Invoice"}).free_fields
        == frozenset()
    )
    assert s("free", topic="orders.{event_type}", aggregate_types={"order"}).free_fields == {
        "event_type"
    }
    assert s("default").free_fields == {"aggregate_type"}


def test_the_topics_an_upgraded_outbox_adopts_are_those_rows_could_reach() -> None:
    guard = TopicGuard("cp")
    guard.update(
        [
            s("orders", topic="orders.{event_type}", aggregate_types={"order"}),
            s("billing", topic="billing.{aggregate_type}", aggregate_types={"Invoice"}),
            s("audit", topic="audit", dead_letter_topic="audit.dead"),
        ]
    )
    assert guard.row_chosen("orders.Placed") and guard.row_chosen("orders.v2.Placed")
    # The operator's topics need no adopting; the relay's and the platform's are refused.
    for topic in ("audit", "billing.Invoice", "cp", "audit.dead", "outbox.dead-letter.orders",
                  "_schemas", "payments"):  # fmt: skip
        assert not guard.row_chosen(topic), topic
