"""Subscribers: which events go where, in which value format."""

from __future__ import annotations

import dataclasses
import functools
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from relay.core.formats import WITH_SCHEMAS, format_of, publishing_format
from relay.core.formats import ValueFormat as ValueFormat  # noqa: PLC0414 (re-exported)
from relay.core.formats.base import Format
from relay.core.formats.base import SubjectStrategy as SubjectStrategy  # noqa: PLC0414 (re-exported)
from relay.core.model import OutboxEvent
from relay.core.routing import DEFAULT_KEY, Routing
from relay.errors import EncodingError, SubscriberError

DEFAULT_TOPIC = "outbox.event.{aggregate_type}"  # Debezium Outbox Event Router's default
DEFAULT_SUBSCRIBER = "default"
MAX_PARTS = 1024
TOPIC_FIELDS = frozenset({"aggregate_type", "event_type"})

DEAD_LETTER_PREFIX = "outbox.dead-letter."
MAX_TOPIC_LENGTH = 249

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_TEMPLATE_FIELD = re.compile(r"\{[a-z_]+\}")
_MAX_CACHED_REFUSALS = 4096


class KeyFormat(StrEnum):
    """The record key: the event's aggregate_id."""

    STRING = "string"  # its UTF-8 bytes, as every value format writes it
    # An Avro string in the Confluent wire format, its schema registered under
    # <topic>-key (TopicNameStrategy, as stock key serializers): avro-registry only.
    AVRO_REGISTRY = "avro-registry"


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
    value_format: ValueFormat = WITH_SCHEMAS
    aggregate_types: frozenset[str] | None = None  # None: every type
    event_types: frozenset[str] | None = None
    paused: bool = False
    parts: int = 1
    on_poison: PoisonPolicy = PoisonPolicy.HALT
    dead_letter_topic: str | None = None  # None: "outbox.dead-letter.<name>"
    subject_strategy: SubjectStrategy = SubjectStrategy.TOPIC  # avro-registry only
    # Routing control (relay/core/routing.py): the key template, the partition field, and
    # "field:header|envelope[:alias]" placements.
    key: str = DEFAULT_KEY
    partition_by: str | None = None
    placements: tuple[str, ...] = ()
    key_format: KeyFormat = KeyFormat.STRING
    partition_count: int | None = None  # with partition_by: the partitions it ranges over

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_topic_template(self.topic)
        if not 1 <= self.parts <= MAX_PARTS:
            raise SubscriberError(f"parts must be between 1 and {MAX_PARTS}, got {self.parts}")
        if self.dead_letter_topic is not None and not legal_topic(self.dead_letter_topic):
            raise SubscriberError(
                f"dead-letter topic {self.dead_letter_topic!r} is not a legal Kafka topic name"
            )
        if self.key_format is KeyFormat.AVRO_REGISTRY and not format_of(self.value_format).registry:
            raise SubscriberError(
                f"subscriber {self.name!r}: key format avro-registry needs value format "
                f"avro-registry (its registry and schemas), not {self.value_format.value}; "
                "use the string key format, or the avro-registry value format"
            )
        self._check_routing()

    def _check_routing(self) -> None:
        routing = self.routing  # parses: a SubscriberError names what is wrong
        if routing.default:
            return
        value_format = format_of(self.value_format)
        if value_format.fixed_routing is not None:
            raise SubscriberError(f"subscriber {self.name!r}: {value_format.fixed_routing}")
        if routing.envelope and not value_format.envelope:
            raise SubscriberError(
                f"subscriber {self.name!r}: an envelope placement changes the value's shape, "
                f"which the {self.value_format.value} format's schema fixes; place the field "
                "in a header, or publish json"
            )

    @functools.cached_property
    def routing(self) -> Routing:
        return Routing.parse(self.key, self.partition_by, self.placements, self.partition_count)

    @functools.cached_property
    def publishing(self) -> Format:
        """The format its values are written in: its value format's, or that format's
        pass-through when its routing reads nothing of the payload (a topic template
        reads only the types; issue #53)."""
        return publishing_format(self.value_format, reads_payload=not self.routing.default)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Subscriber:
        """A subscriber from plain values, as :meth:`as_dict` gives them: a stored row,
        validated settings, the command line's options. Keys that are not fields are
        ignored; a field missing or None takes its default."""
        # A stored row holds the routing fields in one jsonb column, "routing".
        routing = fields.get("routing")
        merged = {**fields, **routing} if isinstance(routing, Mapping) else fields
        given = {f.name: merged[f.name] for f in _FIELDS if merged.get(f.name) is not None}
        kinds: tuple[tuple[str, type[StrEnum]], ...] = (
            ("value_format", ValueFormat),
            ("on_poison", PoisonPolicy),
            ("subject_strategy", SubjectStrategy),
            ("key_format", KeyFormat),
        )
        for name, kind in kinds:
            if name in given:
                given[name] = kind(given[name])
        for name in ("aggregate_types", "event_types"):
            if name in given:
                given[name] = frozenset(given[name])
        if "placements" in given:
            given["placements"] = tuple(given["placements"])
        return cls(**given)

    def as_dict(self) -> dict[str, Any]:
        """The definition as plain values (text for enums, sorted lists for filters), as
        the store writes it and the command line shows it."""
        return {
            **{f.name: getattr(self, f.name) for f in _FIELDS},
            "value_format": self.value_format.value,
            "on_poison": self.on_poison.value,
            "subject_strategy": self.subject_strategy.value,
            "key_format": self.key_format.value,
            "aggregate_types": _sorted(self.aggregate_types),
            "event_types": _sorted(self.event_types),
            "placements": list(self.placements),
        }

    def route(self, aggregate_type: str, event_type: str) -> str | None:
        """The topic of events of this kind; None when that is not a legal topic name."""
        return _route(self.topic, aggregate_type, event_type)

    @property
    def dead_letter_topic_name(self) -> str:
        return self.dead_letter_topic or f"{DEAD_LETTER_PREFIX}{self.name}"

    @functools.cached_property
    def fixed_topic(self) -> str | None:
        """The one topic of a template without fields; None when rows choose it."""
        return None if _TEMPLATE_FIELD.search(self.topic) else self.topic.format()

    @functools.cached_property
    def free_fields(self) -> frozenset[str]:
        """The template's fields no filter lists the values of: a row chooses their
        values, so its topic is the row's choice. Without any, every topic is one the
        operator declared (a fixed topic, or one a filter names) (issue #47)."""
        listed = {"aggregate_type": self.aggregate_types, "event_type": self.event_types}
        used = {f for _, f, _, _ in string.Formatter().parse(self.topic) if f is not None}
        return frozenset(f for f in used if listed[f] is None)

    @property
    def filtered(self) -> bool:
        """Whether a type filter may drop events (else :meth:`matches` takes them all)."""
        return self.aggregate_types is not None or self.event_types is not None

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
                "which is not a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not '.' or '..')"
            )
        return topic


_FIELDS = dataclasses.fields(Subscriber)


def _sorted(values: frozenset[str] | None) -> list[str] | None:
    return None if values is None else sorted(values)


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
    literal = _TEMPLATE_FIELD.sub("x", template)
    if not legal_topic(literal):
        raise SubscriberError(
            f"topic template {template!r} cannot produce a legal Kafka topic name"
        )
    return template


def collision(a: Subscriber, b: Subscriber) -> str | None:
    """Why ``a`` and ``b`` could put one event on one topic (each would publish it: a
    duplicate for its consumers), or share a dead-letter topic; None when they cannot. Identical templates and a fixed topic against a template are
    decided exactly; two different templates are compared over finite filters only."""
    aggregates = _both(a.aggregate_types, b.aggregate_types)
    events = _both(a.event_types, b.event_types)
    if aggregates != frozenset() and events != frozenset():
        if a.topic == b.topic:
            return f"both route matching events to {a.topic!r}"
        for first, second in ((a, b), (b, a)):
            topic = _shared_topic(first.topic, second.topic, aggregates, events)
            if topic is not None:
                return f"both can route an event to {topic!r}"
    if a.dead_letter_topic_name == b.dead_letter_topic_name:
        return f"both dead-letter to {a.dead_letter_topic_name!r}"
    # Events routed into another subscriber's fixed or dead-letter topic are refused as
    # they are routed (TopicGuard): a writer's aggregate type is not a configuration.
    return None


def check_unchanged(stored: Subscriber, before: Subscriber) -> None:
    """A definition replaced must still be ``before``, the one the change was computed
    from (its pause aside: pausing is no change of definition); ``SubscriberError``
    otherwise (a definition's stores' ``replace``)."""
    if dataclasses.replace(stored, paused=before.paused) != before:
        raise SubscriberError(
            f"subscriber {before.name!r} was changed by someone else meanwhile; "
            "nothing was written: run the command again"
        )


def _both(x: frozenset[str] | None, y: frozenset[str] | None) -> frozenset[str] | None:
    """The values both filters let through (None: any)."""
    if x is None:
        return y
    return x if y is None else x & y


def _shared_topic(
    fixed: str,
    template: str,
    aggregates: frozenset[str] | None,
    events: frozenset[str] | None,
) -> str | None:
    """A topic both templates produce for one event: exactly when ``fixed`` has no
    fields; otherwise by trying the event kinds the filters allow, or, where a filter
    allows any, values taken from the templates' own words (the usual way two
    templates meet: "{aggregate_type}.{event_type}" and "order.{event_type}")."""
    if "{" not in fixed:
        return fixed if _renders(template, fixed, aggregates, events) else None
    words = _words(fixed) | _words(template) | {"x"}
    candidates = [aggregates or words, events or words]
    if len(candidates[0]) * len(candidates[1]) > 10_000:
        return None
    for aggregate in candidates[0]:
        for event in candidates[1]:
            topic = fixed.format(aggregate_type=aggregate, event_type=event)
            if topic == template.format(aggregate_type=aggregate, event_type=event):
                return topic
    return None


def _words(template: str) -> set[str]:
    literals = "".join(literal for literal, _, _, _ in string.Formatter().parse(template))
    return {w for w in re.split(r"[^A-Za-z0-9_-]+", literals) if w}


def _renders(
    template: str, topic: str, aggregates: frozenset[str] | None, events: frozenset[str] | None
) -> bool:
    """Whether ``template`` yields ``topic`` for an event the filters let through."""
    pattern, fields = "", []
    for literal, name, _, _ in string.Formatter().parse(template):
        pattern += re.escape(literal)
        if name is not None:
            # A field used twice must take the same value both times.
            pattern += f"(?P={name})" if name in fields else f"(?P<{name}>[A-Za-z0-9._-]+)"
            fields.append(name)
    match = re.fullmatch(pattern, topic)
    if match is None:
        return False
    allowed = {"aggregate_type": aggregates, "event_type": events}
    return all(allowed[f] is None or match[f] in allowed[f] for f in set(fields))  # type: ignore[operator]


def legal_topic(name: str) -> bool:
    """Apache Kafka's rules for a topic name: 1-249 of [a-zA-Z0-9._-], but not '.' or
    '..'. (Names that differ only in '.' against '_' collide too; only the broker knows
    which exist, so that refusal comes from it.)"""
    return bool(_TOPIC.match(name)) and name not in (".", "..")


@functools.lru_cache(maxsize=4096)
def _route(template: str, aggregate_type: str, event_type: str) -> str | None:
    """The topic of an event, or None when it is not a legal name (cached: per event,
    formatting and checking the name cost more than encoding its key)."""
    topic = template.format(aggregate_type=aggregate_type, event_type=event_type)
    return topic if legal_topic(topic) else None


# Topics of the platform around Kafka: a leading "_" marks internal ones (Kafka's own
# __*, Schema Registry's _schemas, Confluent's _confluent-*), and Kafka Connect keeps
# its configs, offsets and status in connect-* by convention.
INTERNAL_PREFIXES = ("_", "connect-")


class TopicGuard:
    """Topics no row may be routed to (issue #17, item 6; issue #27): internal topics
    (INTERNAL_PREFIXES), the relay's checkpoint topic, every dead-letter topic, and
    another subscriber's topics, fixed or templated; with ``allow``, every topic it does
    not match in full.

    A templated topic is another subscriber's when its template produces it for an event
    its filters let through, with a field its filters do not name taking a value
    without ".": a row that puts a "." into its aggregate or event type to reach into
    another subscriber's topics is refused, while one subscriber's template that is a
    prefix of another's ("events.{aggregate_type}" and "events.{aggregate_type}.v2") does
    not shut the other out.

    One per relay, shared by its workers; the supervisor refreshes it from the
    subscriber list (:meth:`update`). A refusal is the row's poison.
    """

    def __init__(self, checkpoint_topic: str, allow: re.Pattern[str] | None = None) -> None:
        self._checkpoint = checkpoint_topic
        self._allow = allow
        # topic -> (the subscriber it belongs to, or "" for the relay's own, what it is)
        self._reserved: dict[str, tuple[str, str]] = {}
        self._templates: tuple[_TemplateClaim, ...] = ()
        self._refusals: dict[tuple[str, str], str | None] = {}  # cache, per subscriber
        self.update(())

    def update(self, subscribers: Iterable[Subscriber]) -> None:
        subscribers = list(subscribers)
        reserved = {self._checkpoint: ("", "the relay's checkpoint topic")}
        for s in subscribers:
            if s.fixed_topic is not None:
                reserved.setdefault(s.fixed_topic, (s.name, f"subscriber {s.name!r}'s topic"))
        for s in subscribers:  # dead-letter topics take precedence: nobody routes there
            reserved[s.dead_letter_topic_name] = ("", f"subscriber {s.name!r}'s dead-letter topic")
        templates = tuple(_TemplateClaim.of(s) for s in subscribers if s.fixed_topic is None)
        if reserved != self._reserved or templates != self._templates:
            # Swapped whole, never mutated: workers read them without a lock.
            self._reserved, self._templates, self._refusals = reserved, templates, {}

    def row_chosen(self, topic: str) -> bool:
        """Whether a row can route events to ``topic`` through a template field no
        filter lists (the topics an upgraded outbox adopts); never a reserved or
        internal topic, nor one ``allow`` refuses."""
        if topic.startswith(INTERNAL_PREFIXES) or topic in self._reserved:
            return False
        if topic.startswith(DEAD_LETTER_PREFIX) or not self.allow_listed(topic, True):
            return False
        return any(claim.free and claim.reach.fullmatch(topic) for claim in self._templates)

    def allow_listed(self, topic: str, unset: bool = False) -> bool:
        """Whether ``topic_allow`` matches ``topic`` in full (``unset`` when there is no
        ``topic_allow``)."""
        return unset if self._allow is None else self._allow.fullmatch(topic) is not None

    def relay_owned(self, topic: str) -> bool:
        """The checkpoint topic or a dead-letter topic: the relay's own, not a row's."""
        owner = self._reserved.get(topic)
        return (owner is not None and owner[0] == "") or topic.startswith(DEAD_LETTER_PREFIX)

    def refusal(self, topic: str, subscriber: Subscriber) -> str | None:
        """Why events of ``subscriber`` may not go to ``topic``; None when they may."""
        refusals = self._refusals
        key = (subscriber.name, topic)
        if key not in refusals:
            if len(refusals) >= _MAX_CACHED_REFUSALS:  # writers choose topics: stay bounded
                refusals.clear()
            refusals[key] = self._judge(topic, subscriber.name)
        return refusals[key]

    def _judge(self, topic: str, subscriber: str) -> str | None:
        if topic.startswith("__"):
            return "topics starting with '__' are Kafka's internal topics"
        if topic.startswith(INTERNAL_PREFIXES):
            return (
                f"topics starting with {' or '.join(map(repr, INTERNAL_PREFIXES))} are "
                "internal (Schema Registry's _schemas, _confluent-*, Kafka Connect's connect-*)"
            )
        owner = self._reserved.get(topic)
        if owner is not None and owner[0] != subscriber:
            return f"it is {owner[1]}"
        if topic.startswith(DEAD_LETTER_PREFIX):
            return f"topics starting with {DEAD_LETTER_PREFIX!r} are dead-letter topics"
        for claim in () if owner is not None else self._templates:  # its own fixed topic
            if claim.subscriber != subscriber and claim.produces(topic):
                return f"subscriber {claim.subscriber!r}'s topic template {claim.template!r} produces it"
        if self._allow is not None and not self._allow.fullmatch(topic):
            return f"topic_allow ({self._allow.pattern!r}) does not match it"
        return None


@dataclass(frozen=True)
class _TemplateClaim:
    """The topics a subscriber's template produces for the events it takes: a field
    its filters name takes one of their values; one they do not, a value without "."
    (``pattern``), or any value (``reach``: every topic a row can route it to)."""

    subscriber: str
    template: str
    pattern: re.Pattern[str]
    reach: re.Pattern[str]
    free: bool  # a field no filter lists: rows choose the topic

    @classmethod
    def of(cls, subscriber: Subscriber) -> _TemplateClaim:
        return cls(
            subscriber.name,
            subscriber.topic,
            _template_pattern(subscriber, "[A-Za-z0-9_-]+"),
            _template_pattern(subscriber, "[A-Za-z0-9._-]+"),
            bool(subscriber.free_fields),
        )

    def produces(self, topic: str) -> bool:
        return self.pattern.fullmatch(topic) is not None


def _template_pattern(subscriber: Subscriber, unfiltered: str) -> re.Pattern[str]:
    allowed = {"aggregate_type": subscriber.aggregate_types, "event_type": subscriber.event_types}
    pattern, seen = "", set()
    for literal, name, _, _ in string.Formatter().parse(subscriber.topic):
        pattern += re.escape(literal)
        if name is None:
            continue
        if name in seen:  # one field used twice takes one value
            pattern += f"(?P={name})"
            continue
        seen.add(name)
        values = allowed[name]
        choices = (
            unfiltered
            if values is None
            else "|".join(re.escape(v) for v in sorted(values)) or "(?!)"
        )
        pattern += f"(?P<{name}>{choices})"
    return re.compile(pattern)


def partition_shortfall(
    subscriber: Subscriber,
    existing: Mapping[str, int],
    *,
    create_topics: bool,
    topic_partitions: int,
) -> str | None:
    """Why ``subscriber``'s topics cannot take every partition its partition field
    ranges over (``partition_count``), or None when they can. ``existing``: the
    cluster's topics and their partition counts; a topic the relay is still to create
    gets ``topic_partitions``. Checked by ``subscribers add`` and at start-up, where a
    row naming a partition that is not there would otherwise be found one row at a time."""
    need = subscriber.partition_count
    if need is None:
        return None
    what = f"partition_count (--partition-count) is {need}"
    fixed = subscriber.fixed_topic
    if fixed is None:
        reach = _TemplateClaim.of(subscriber).reach
        short = sorted(t for t, n in existing.items() if n < need and reach.fullmatch(t))
    else:
        short = [fixed] if existing.get(fixed, need) < need else []
    if short:
        return (
            f"{what}, but its topic {short[0]!r} has {existing[short[0]]} partitions; add "
            f"partitions to the topic (kafka-topics.sh --alter --partitions {need}), or "
            "lower partition_count"
        )
    if fixed is not None and fixed in existing:
        return None
    if not create_topics:
        if fixed is None:  # rows naming a missing topic are refused one by one anyway
            return None
        return (
            f"{what}, but its topic {fixed!r} does not exist and create_topics is false; "
            f"create it with {need} partitions: outbox-relay topics create {fixed} "
            f"--partitions {need}"
        )
    if topic_partitions < need:
        return (
            f"{what}, but the relay creates the subscriber's topics with topic_partitions "
            f"({topic_partitions}) partitions; raise topic_partitions to {need} (as the "
            "relay has it), or create the topics first with `outbox-relay topics create "
            f"--partitions {need}`"
        )
    return None
