"""Turns outbox rows into Kafka records for a subscriber."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import orjson

from relay.core.model import (
    HEADER_AGGREGATE_TYPE,
    HEADER_EVENT_TYPE,
    HEADER_ID,
    HEADER_POSITION,
    HEADER_TRANSACTION_ID,
    HEADER_VERSION,
    RESERVED_HEADER_PREFIX,
    KafkaRecord,
    OutboxEvent,
    Unreadable,
)
from relay.core.routing import RESERVED_HEADER_NAMES, Routing
from relay.core.schemas import SchemaFolder
from relay.core.subscribers import KeyFormat, Subscriber, TopicGuard, ValueFormat
from relay.engine.debezium_format import debezium_record
from relay.errors import ConfigError, EncodingError, PayloadValidationError

if TYPE_CHECKING:  # the registry client is imported only by relays that use it
    from relay.adapters.registry.registry_format import RegistryValueEncoder


class RecordEncoder:
    def __init__(
        self,
        registry: SchemaFolder | None,
        guard: TopicGuard | None = None,
        schema_registry: RegistryValueEncoder | None = None,
    ) -> None:
        self.registry = registry
        self.guard = guard
        # avro-registry values: None when the relay has no schema_registry_url.
        self.schema_registry = schema_registry
        # What encode works out once per subscriber rather than per event; keyed by the
        # subscriber object's identity (hashing a Subscriber costs more than an event's
        # encoding), the object kept in the value so a recycled id never matches.
        self._plans: dict[int, tuple[Subscriber, _Plan]] = {}
        self._types: dict[tuple[str, str], _TypeHeaders] = {}

    def encode(self, event: OutboxEvent, subscriber: Subscriber) -> KafkaRecord:
        """The record for ``event``; :class:`EncodingError` marks a poison event."""
        if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
            _refuse_unreadable(event)
        plan = self._plan(subscriber)
        if plan.debezium:
            framing = None if self.schema_registry is None else self.schema_registry.frame_text
            record = debezium_record(event, subscriber, framing)
            self._check_route(record.topic, subscriber, event)
            return record
        topic = plan.topic if plan.topic is not None else subscriber.topic_for(event)
        # Every time, not once per plan: the guard changes as subscribers come and go.
        self._check_route(topic, subscriber, event)
        routing = subscriber.routing
        if not routing.default:
            return self._routed(event, subscriber, topic, routing)
        value = self._value(event, subscriber, topic)
        key = self._key(subscriber, topic, event.aggregate_id)
        headers, headers_size = self._headers(event)
        size = len(key) + len(value) + headers_size
        return _record((topic, key, value, headers, size, plan.topic is None, None, None, None))

    def _plan(self, subscriber: Subscriber) -> _Plan:
        entry = self._plans.get(id(subscriber))
        if entry is not None and entry[0] is subscriber:
            return entry[1]
        plan = _Plan(subscriber.value_format is ValueFormat.DEBEZIUM, subscriber.fixed_topic)
        if len(self._plans) >= _MAX_CACHED:  # subscribers reloaded over days: stay bounded
            self._plans.clear()
        self._plans[id(subscriber)] = (subscriber, plan)
        return plan

    def _headers(self, event: OutboxEvent) -> tuple[list[tuple[str, str | bytes | None]], int]:
        """The record headers and their size in bytes. The event and aggregate type
        headers repeat from event to event: made once and reused."""
        types = self._types.get((event.event_type, event.aggregate_type))
        if types is None:
            types = _type_headers(event.event_type, event.aggregate_type)
            if len(self._types) >= _MAX_CACHED:  # writers choose the types: stay bounded
                self._types.clear()
            self._types[(event.event_type, event.aggregate_type)] = types
        message_id = event.id_text or str(event.message_id).encode()
        transaction_id = b"%d" % event.transaction_id
        position = b"%d" % event.position
        headers: list[tuple[str, str | bytes | None]] = [
            (HEADER_ID, message_id),
            types.event_type,
            types.aggregate_type,
            (HEADER_TRANSACTION_ID, transaction_id),
            (HEADER_POSITION, position),
        ]
        size = types.size + len(message_id) + len(transaction_id) + len(position)
        if event.aggregate_version is not None or event.headers:
            size += _more_headers(event, headers)
        return headers, size

    def _routed(
        self, event: OutboxEvent, subscriber: Subscriber, topic: str, routing: Routing
    ) -> KafkaRecord:
        """The record under the subscriber's routing control: its key, its partition,
        its placements (the default routing takes the shorter way in :meth:`encode`)."""
        key = self._key(subscriber, topic, routing.key_text(event))
        partition = routing.partition_for(event)
        if routing.envelope:  # json only (Subscriber refuses it for the other formats)
            wrapped = {"payload": event.payload, **routing.envelope_values(event)}
            value = self._value(event._replace(payload=wrapped), subscriber, topic)
        else:
            value = self._value(event, subscriber, topic)
        placed = routing.header_values(event)  # the relay's own names are refused
        names = {name for name, _ in placed}  # placed over the row's header of that name
        headers = [h for h in self._headers(event)[0] if h[0] not in names]
        headers += placed
        size = len(key) + len(value) + sum(len(n) + len(v or b"") for n, v in headers)
        return KafkaRecord(
            topic,
            key,
            value,
            headers,
            size,
            subscriber.fixed_topic is None,
            partition=partition,
        )

    def _check_route(self, topic: str, subscriber: Subscriber, event: OutboxEvent) -> None:
        if self.guard is not None and (refusal := self.guard.refusal(topic, subscriber)):
            raise EncodingError(f"event {event.message_id}: not routed to {topic!r}: {refusal}")

    def _value(self, event: OutboxEvent, subscriber: Subscriber, topic: str) -> bytes:
        if subscriber.value_format is ValueFormat.AVRO_REGISTRY:
            return self._registry_value(event, subscriber, topic)
        if subscriber.value_format is ValueFormat.JSON:
            try:
                # The same compact UTF-8 JSON as the standard library's, at a tenth of
                # the cost per event (exponents aside: 1e-7, not 1e-07).
                return orjson.dumps(event.payload)
            except orjson.JSONEncodeError:
                pass  # integers beyond 64 bits, nesting beyond 255: the standard library
            try:
                return json.dumps(event.payload, separators=(",", ":"), ensure_ascii=False).encode()
            except (ValueError, TypeError, RecursionError) as exc:
                raise EncodingError(
                    f"event {event.message_id}: payload cannot be written as JSON "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
        if self.registry is None:
            # The relay's configuration, never the row's fault: no dead letter (issue #28).
            raise ConfigError(
                f"subscriber {subscriber.name!r} publishes avro, but this relay has no "
                "schemas folder (schemas_dir, RELAY_SCHEMAS_DIR or --schemas-dir): configure "
                "it, or switch the subscriber to json, then `outbox-relay subscribers resume "
                f"{subscriber.name}`"
            )
        try:
            return self.registry.encode(event.event_type, event.payload)
        except PayloadValidationError as exc:
            raise EncodingError(
                f"event {event.message_id} cannot be encoded as Avro: {exc}"
            ) from exc

    def _key(self, subscriber: Subscriber, topic: str, text: str) -> bytes:
        """The key's bytes: its text (the aggregate id, or the subscriber's key
        template's), as is or registry-encoded."""
        if subscriber.key_format is KeyFormat.STRING:
            return text.encode()
        # Only avro-registry subscribers have other keys, and _value found their encoder.
        assert self.schema_registry is not None
        return self.schema_registry.encode_key(topic, text)

    def _registry_value(self, event: OutboxEvent, subscriber: Subscriber, topic: str) -> bytes:
        if self.schema_registry is None or self.schema_registry.schemas is None:
            # The relay's configuration, never the row's fault: no dead letter.
            raise ConfigError(
                f"subscriber {subscriber.name!r} publishes avro-registry, but this relay has "
                "no schema registry or no schemas folder (schema_registry_url, "
                "RELAY_SCHEMA_REGISTRY_URL; schemas_dir, RELAY_SCHEMAS_DIR): configure them, "
                f"then `outbox-relay subscribers resume {subscriber.name}`"
            )
        try:
            return self.schema_registry.encode(
                topic, event.event_type, event.payload, subscriber.subject_strategy
            )
        except PayloadValidationError as exc:
            raise EncodingError(
                f"event {event.message_id} cannot be encoded as Avro: {exc}"
            ) from exc


def _refuse_unreadable(event: OutboxEvent) -> NoReturn:
    for column, value in (("payload", event.payload), ("headers", event.headers)):
        if isinstance(value, Unreadable):
            what = f"its {column} is {value}" if value.read else str(value)
            raise EncodingError(f"event {event.message_id}: {what}")
    raise AssertionError("no unreadable column")


def headers_for(event: OutboxEvent) -> list[tuple[str, str | bytes | None]]:
    types = _type_headers(event.event_type, event.aggregate_type)
    headers: list[tuple[str, str | bytes | None]] = [
        (HEADER_ID, event.id_text or str(event.message_id).encode()),
        types.event_type,
        types.aggregate_type,
        (HEADER_TRANSACTION_ID, b"%d" % event.transaction_id),
        (HEADER_POSITION, b"%d" % event.position),
    ]
    _more_headers(event, headers)
    return headers


# A plain call of tuple.__new__: a NamedTuple's own __new__ is a Python function, and
# this runs for every event.
_record = functools.partial(tuple.__new__, KafkaRecord)
# Cached plans and type headers at most (rows choose their types; subscribers reload).
_MAX_CACHED = 4096
_ID_NAMES_SIZE = len(HEADER_ID) + len(HEADER_TRANSACTION_ID) + len(HEADER_POSITION)


class _Plan(NamedTuple):
    """What encoding a subscriber's events needs to know of it, worked out once."""

    debezium: bool
    topic: str | None  # the subscriber's one topic; None: rows choose it


class _TypeHeaders(NamedTuple):
    event_type: tuple[str, bytes]
    aggregate_type: tuple[str, bytes]
    size: int  # of both, and of the names of the id, transaction id and position headers


def _type_headers(event_type: str, aggregate_type: str) -> _TypeHeaders:
    event_type_bytes, aggregate_type_bytes = event_type.encode(), aggregate_type.encode()
    size = _ID_NAMES_SIZE + len(HEADER_EVENT_TYPE) + len(event_type_bytes)
    size += len(HEADER_AGGREGATE_TYPE) + len(aggregate_type_bytes)
    return _TypeHeaders(
        (HEADER_EVENT_TYPE, event_type_bytes), (HEADER_AGGREGATE_TYPE, aggregate_type_bytes), size
    )


def _more_headers(event: OutboxEvent, headers: list[tuple[str, str | bytes | None]]) -> int:
    """Append the aggregate version and the row's own headers (usually neither) to
    ``headers``; returns their size in bytes."""
    size = 0
    if event.aggregate_version is not None:
        version = b"%d" % event.aggregate_version
        headers.append((HEADER_VERSION, version))
        size += len(HEADER_VERSION) + len(version)
    if event.headers:
        extra = [
            (name, _header_bytes(value))
            for name, value in event.headers.items()
            if name not in RESERVED_HEADER_NAMES and not name.startswith(RESERVED_HEADER_PREFIX)
        ]
        headers.extend(extra)
        size += sum(len(name) + len(value) for name, value in extra)
    return size


def _header_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()
