"""Turns outbox rows into Kafka records for a subscriber."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from relay.debezium_format import debezium_record
from relay.errors import ConfigError, EncodingError, PayloadValidationError
from relay.model import (
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
from relay.routing import Routing
from relay.schemas import SchemaFolder
from relay.subscribers import KeyFormat, Subscriber, TopicGuard, ValueFormat

if TYPE_CHECKING:  # the registry client is imported only by relays that use it
    from relay.registry_format import RegistryValueEncoder

RESERVED_HEADERS = frozenset(
    {
        HEADER_ID,
        HEADER_EVENT_TYPE,
        HEADER_AGGREGATE_TYPE,
        HEADER_TRANSACTION_ID,
        HEADER_POSITION,
        HEADER_VERSION,
    }
)


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

    def encode(self, event: OutboxEvent, subscriber: Subscriber) -> KafkaRecord:
        """The record for ``event``; :class:`EncodingError` marks a poison event."""
        if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
            _refuse_unreadable(event)
        if subscriber.value_format is ValueFormat.DEBEZIUM:
            record = debezium_record(event, subscriber)
            self._check_route(record.topic, subscriber, event)
            return record
        topic = subscriber.topic_for(event)
        self._check_route(topic, subscriber, event)
        routing = subscriber.routing
        if not routing.default:
            return self._routed(event, subscriber, topic, routing)
        value = self._value(event, subscriber, topic)
        key = self._key(subscriber, topic, event.aggregate_id)
        headers, headers_size = _headers(event)
        size = len(key) + len(value) + headers_size
        return KafkaRecord(topic, key, value, headers, size, subscriber.fixed_topic is None)

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
        headers = [h for h in _headers(event)[0] if h[0] not in names]
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
        if self.schema_registry is None:
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
    return _headers(event)[0]


_FIXED_NAMES_SIZE = sum(
    map(len, (HEADER_ID, HEADER_EVENT_TYPE, HEADER_AGGREGATE_TYPE, HEADER_TRANSACTION_ID))
) + len(HEADER_POSITION)


def _headers(event: OutboxEvent) -> tuple[list[tuple[str, str | bytes | None]], int]:
    """The record headers and their size in bytes (this runs for every event: the size
    is summed from the parts at hand rather than by walking the list again)."""
    message_id = str(event.message_id).encode()
    event_type = event.event_type.encode()
    aggregate_type = event.aggregate_type.encode()
    transaction_id = str(event.transaction_id).encode()
    position = str(event.position).encode()
    headers: list[tuple[str, str | bytes | None]] = [
        (HEADER_ID, message_id),
        (HEADER_EVENT_TYPE, event_type),
        (HEADER_AGGREGATE_TYPE, aggregate_type),
        (HEADER_TRANSACTION_ID, transaction_id),
        (HEADER_POSITION, position),
    ]
    size = _FIXED_NAMES_SIZE + len(message_id) + len(event_type) + len(aggregate_type)
    size += len(transaction_id) + len(position)
    if event.aggregate_version is not None:
        version = str(event.aggregate_version).encode()
        headers.append((HEADER_VERSION, version))
        size += len(HEADER_VERSION) + len(version)
    if event.headers:  # usually empty
        extra = [
            (name, _header_bytes(value))
            for name, value in event.headers.items()
            if name not in RESERVED_HEADERS and not name.startswith(RESERVED_HEADER_PREFIX)
        ]
        headers.extend(extra)
        size += sum(len(name) + len(value) for name, value in extra)
    return headers, size


def _header_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()
