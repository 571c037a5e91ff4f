"""Issue #48: a subscriber's definition, its rules held once (relay/ops/subscribers.py):
the format's default, the definition's own rules, and what a change changes (the
store, the registry and the broker: tests/acceptance/test_subscriber_definitions.py)."""

from __future__ import annotations

import dataclasses

import pytest

from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.errors import ConfigError
from relay.ops.subscribers import Change, Setup, check, define

NO_SCHEMAS = Setup(load_settings())
SCHEMAS = Setup(load_settings(), SchemaFolder([]))


def test_a_subscriber_naming_no_format_publishes_avro_only_with_writer_schemas() -> None:
    assert define(NO_SCHEMAS, {"name": "s"}).value_format is ValueFormat.JSON
    assert define(SCHEMAS, {"name": "s", "value_format": None}).value_format is ValueFormat.AVRO
    assert define(SCHEMAS, {"name": "s", "value_format": "json"}).value_format is ValueFormat.JSON


def test_a_dead_letter_topic_needs_the_dead_letter_policy() -> None:
    with pytest.raises(ConfigError, match="--on-poison dead-letter"):
        define(NO_SCHEMAS, {"name": "s", "dead_letter_topic": "s.dlq"})
    assert (
        define(
            NO_SCHEMAS, {"name": "s", "dead_letter_topic": "s.dlq", "on_poison": "dead-letter"}
        ).dead_letter_topic
        == "s.dlq"
    )


def test_avro_without_writer_schemas_is_refused_naming_the_key_and_the_fix() -> None:
    avro = Subscriber("s", value_format=ValueFormat.AVRO)
    [refusal] = check(NO_SCHEMAS, [avro]).refusals
    assert refusal.subscriber == "s"
    assert "schemas_dir" in str(refusal.error)
    assert "subscribers set s --format json" in str(refusal.error)
    assert check(SCHEMAS, [avro]).refusals == []
    with pytest.raises(ConfigError, match=r"(?s)publishes avro.*\nfix it"):
        check(NO_SCHEMAS, [avro]).refuse(lambda name: "fix it")


def test_a_change_shows_each_field_it_changes_old_and_new() -> None:
    before = Subscriber("s", topic="t", value_format=ValueFormat.JSON,
                        aggregate_types=frozenset({"order"}))  # fmt: skip
    after = Subscriber("s", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER)
    shown = [str(d) for d in Change(before, after).differences]
    assert shown == [
        "topic: t → outbox.event.{aggregate_type}",
        "aggregate_types: order → (all)",
        "on_poison: halt → dead-letter",
    ]
    assert Change(before, dataclasses.replace(before, paused=True)).differences == []
    assert Change(None, after).changed and not Change(before, before).changed


@pytest.mark.parametrize(
    ("old", "new", "narrowed", "widened"),
    [
        (None, {"order"}, True, False),
        ({"order"}, None, False, True),
        ({"order"}, {"order", "customer"}, False, True),
        ({"order", "customer"}, {"order"}, True, False),
        ({"order"}, {"customer"}, True, True),
        ({"order"}, {"order"}, False, False),
    ],
)
def test_a_filter_narrows_when_it_drops_a_kind_it_took_and_widens_when_it_adds_one(
    old: set[str] | None, new: set[str] | None, narrowed: bool, widened: bool
) -> None:
    def with_filter(types: set[str] | None) -> Subscriber:
        return Subscriber("s", aggregate_types=None if types is None else frozenset(types))

    change = Change(with_filter(old), with_filter(new))
    assert bool(change.narrowed) is narrowed
    assert bool(change.widened) is widened
    assert Change(None, with_filter(new)).narrowed == []  # a new subscriber drops nothing
