"""Subscribers: which events go where, in which value format."""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from relay.errors import EncodingError, SubscriberError
from relay.model import OutboxEvent

DEFAULT_TOPIC = "outbox.event.{aggregate_type}"  # Debezium Outbox Event Router's default
DEFAULT_SUBSCRIBER = "default"
MAX_PARTS = 1024
TOPIC_FIELDS = frozenset({"aggregate_type", "event_type"})

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


class ValueFormat(StrEnum):
    AVRO = "avro"
    JSON = "json"
    DEBEZIUM = "debezium"  # as Debezium's Outbox Event Router (relay/debezium_format.py)


class StartFrom(StrEnum):
    BEGINNING = "beginning"
    NOW = "now"


class PoisonPolicy(StrEnum):
    """What to do with an event that cannot be encoded or that the broker rejects."""

    HALT = "halt"  # stop this subscriber part until a human resumes it
    DEAD_LETTER = "dead-letter"  # publish it with its error to the dead-letter topic


@dataclass(frozen=True)
class Subscriber:
    """A named consumer of the outbox with its own filter, routing, format and checkpoint."""

    name: str
    topic: str = DEFAULT_TOPIC
    value_format: ValueFormat = ValueFormat.AVRO
    aggregate_types: frozenset[str] | None = None  # None: every type
    event_types: frozenset[str] | None = None
    paused: bool = False
    parts: int = 1
    on_poison: PoisonPolicy = PoisonPolicy.HALT
    dead_letter_topic: str | None = None  # None: "outbox.dead-letter.<name>"

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_topic_template(self.topic)
        if not 1 <= self.parts <= MAX_PARTS:
            raise SubscriberError(f"parts must be between 1 and {MAX_PARTS}, got {self.parts}")
        if self.dead_letter_topic is not None and not _TOPIC.match(self.dead_letter_topic):
            raise SubscriberError(
                f"dead-letter topic {self.dead_letter_topic!r} is not a legal Kafka topic name"
            )

    @property
    def dead_letter_topic_name(self) -> str:
        return self.dead_letter_topic or f"outbox.dead-letter.{self.name}"

    def matches(self, event: OutboxEvent) -> bool:
        return (self.aggregate_types is None or event.aggregate_type in self.aggregate_types) and (
            self.event_types is None or event.event_type in self.event_types
        )

    def topic_for(self, event: OutboxEvent) -> str:
        topic = _route(self.topic, event.aggregate_type, event.event_type)
        if topic is None:
            raise EncodingError(
                f"event {event.message_id}: routed to "
                f"{self.topic.format(aggregate_type=event.aggregate_type, event_type=event.event_type)!r}, "
                "which is not a legal Kafka topic name (1-249 of [a-zA-Z0-9._-])"
            )
        return topic


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SubscriberError(
            f"subscriber name {name!r} is invalid: use 1-128 of [A-Za-z0-9._-], starting alphanumeric"
        )
    return name


def validate_topic_template(template: str) -> str:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise SubscriberError(f"topic template {template!r} is malformed: {exc}") from exc
    unknown = fields - TOPIC_FIELDS
    if unknown:
        raise SubscriberError(
            f"topic template {template!r} uses unknown field(s) {sorted(unknown)}; "
            f"allowed: {sorted(TOPIC_FIELDS)}"
        )
    literal = re.sub(r"\{[a-z_]+\}", "x", template)
    if not _TOPIC.match(literal):
        raise SubscriberError(
            f"topic template {template!r} cannot produce a legal Kafka topic name"
        )
    return template


def optional_set(values: Iterable[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)


@functools.lru_cache(maxsize=4096)
def _route(template: str, aggregate_type: str, event_type: str) -> str | None:
    """The topic of an event, or None when it is not a legal name (cached: per event,
    formatting and checking the name cost more than encoding its key)."""
    topic = template.format(aggregate_type=aggregate_type, event_type=event_type)
    return topic if _TOPIC.match(topic) else None
