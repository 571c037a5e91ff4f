"""Turns outbox rows into Kafka records for a subscriber: the one way in for every value
format. :meth:`RecordEncoder.for_subscriber` picks a subscriber's path once (its value
format's writer, its key format, its topic, its routing); the worker then calls that
path once per event, or :meth:`RecordEncoder.for_batches`' once per batch (docs/design.md
§5, "A batch's way through")."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from relay.core.formats import local_formats
from relay.core.formats.base import SchemaRegistry
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
from relay.core.routing import RESERVED_HEADER_NAMES
from relay.core.schemas import SchemaFolder
from relay.core.subscribers import KeyFormat, Subscriber, TopicGuard
from relay.errors import EncodingError

# Value formats encoded without asking a registry: encoding an event again gives the
# same record or the same error (the worker encodes their batches in one loop).
LOCAL_FORMATS = local_formats()


class RecordEncoder:
    """Turns events into records: :meth:`for_subscriber` chooses, once per subscriber,
    how its events are encoded (value format, key format, topic, routing), and the
    chosen :class:`SubscriberEncoder` encodes each event without choosing again."""

    def __init__(
        self,
        registry: SchemaFolder | None,
        guard: TopicGuard | None = None,
        schema_registry: SchemaRegistry | None = None,
    ) -> None:
        self.registry = registry
        self.guard = guard
        # avro-registry values: None when the relay has no schema_registry_url.
        self.schema_registry = schema_registry
        # Keyed by the subscriber object's identity (hashing a Subscriber costs more than
        # an event's encoding), the object kept in the value so a recycled id never matches.
        self._chosen: dict[int, tuple[Subscriber, SubscriberEncoder]] = {}
        # Shared by every subscriber's encoder: rows choose their types.
        self._types: dict[tuple[str, str], _TypeHeaders] = {}

    def encode(self, event: OutboxEvent, subscriber: Subscriber) -> KafkaRecord:
        """The record for ``event``; :class:`EncodingError` marks a poison event."""
        return self.for_subscriber(subscriber)(event)

    def for_subscriber(self, subscriber: Subscriber) -> Callable[[OutboxEvent], KafkaRecord]:
        """How ``subscriber``'s events are encoded: one call per event, which raises
        :class:`EncodingError` for a poison event."""
        return self._chosen_for(subscriber).encode

    def for_batches(
        self, subscriber: Subscriber
    ) -> Callable[[list[OutboxEvent]], list[KafkaRecord]]:
        """How a batch of ``subscriber``'s events is encoded whole, every event of it
        (no filter applied): one call per batch, which raises at the first event that
        does not encode; the caller then encodes event by event to name it."""
        return self._chosen_for(subscriber).encode_all

    def _chosen_for(self, subscriber: Subscriber) -> SubscriberEncoder:
        entry = self._chosen.get(id(subscriber))
        if entry is not None and entry[0] is subscriber:
            return entry[1]
        chosen = SubscriberEncoder(self, subscriber)
        if len(self._chosen) >= _MAX_CACHED:  # subscribers reloaded over days: stay bounded
            self._chosen.clear()
        self._chosen[id(subscriber)] = (subscriber, chosen)
        return chosen

    def type_headers(self, event_type: str, aggregate_type: str) -> _TypeHeaders:
        """The event and aggregate type headers, which repeat from event to event: made
        once and reused."""
        types = self._types.get((event_type, aggregate_type))
        if types is None:
            types = _type_headers(event_type, aggregate_type)
            if len(self._types) >= _MAX_CACHED:  # writers choose the types: stay bounded
                self._types.clear()
            self._types[(event_type, aggregate_type)] = types
        return types


class SubscriberEncoder:
    """One subscriber's encoding, chosen once (:meth:`RecordEncoder.for_subscriber`):
    ``encode`` is the path of its format and routing, its value writer is picked by
    the value format, so no event dispatches on either again."""

    def __init__(self, owner: RecordEncoder, subscriber: Subscriber) -> None:
        self._owner, self._subscriber = owner, subscriber
        # Every time, not once here: the guard changes as subscribers come and go.
        self._guard = owner.guard
        self._topic = subscriber.fixed_topic  # None: the row's fields make it
        # Whether a row's field no filter lists makes it: then the topic is the row's
        # choice, confined by the publisher (issue #47); else the operator declared it.
        self._free = bool(subscriber.free_fields)
        self._routing = subscriber.routing
        value_format = subscriber.publishing
        self._value = (
            _no_values if value_format.values is None else (value_format.values(owner, subscriber))
        )
        self._string_key = subscriber.key_format is KeyFormat.STRING
        # The last transaction's header: a transaction's events come together, so its
        # header is made once per transaction, not per event. A tuple swapped whole:
        # the parts of one subscriber share this encoder across threads.
        self._tx: tuple[int, tuple[str, bytes], int] = (-1, (HEADER_TRANSACTION_ID, b""), 0)
        # Likewise the last event's type headers: runs of one type are the usual batch.
        self._types = _type_headers("", "")
        self.encode: Callable[[OutboxEvent], KafkaRecord]
        self.encode_all: Callable[[list[OutboxEvent]], list[KafkaRecord]] = self._each
        if value_format.records is not None:  # the format makes the whole record
            self._whole = value_format.records(owner, subscriber)
            self.encode = self._own_record
        elif self._routing.default:
            self.encode, self.encode_all = self._plain, self._plain_all
        else:
            self.encode = self._routed

    def _each(self, events: list[OutboxEvent]) -> list[KafkaRecord]:
        return list(map(self.encode, events))

    def _plain_all(self, events: list[OutboxEvent]) -> list[KafkaRecord]:
        """:meth:`_plain` over a whole batch: the guard asked once per topic rather than
        once per event, the headers made in the loop, and the encoder's attributes read
        once (at 1-2 µs of relay CPU per event, each lookup and call is a few percent)."""
        fixed, topic_for, value_of = self._topic, self._subscriber.topic_for, self._value
        string_key, free, owner = self._string_key, self._free, self._owner
        types, tx = self._types, self._tx
        routed: set[str] = set()  # the topics the guard admitted in this batch
        records: list[KafkaRecord] = []
        append = records.append
        for event in events:
            if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
                _refuse_unreadable(event)
            topic = fixed if fixed is not None else topic_for(event)
            if topic not in routed:
                self._check_route(topic, event)
                routed.add(topic)
            value = value_of(event, topic)
            text = event.aggregate_id
            key = text.encode() if string_key else self._registry_key(topic, text)
            names = types.names
            if names[0] != event.event_type or names[1] != event.aggregate_type:
                types = owner.type_headers(event.event_type, event.aggregate_type)
            if tx[0] != event.transaction_id:
                tx = _tx_header(event.transaction_id)
            headers, size = _event_headers(event, types, tx)
            size += len(key) + len(value)
            append(_record((topic, key, value, headers, size, free, None, None, None)))
        self._types, self._tx = types, tx
        return records

    def _plain(self, event: OutboxEvent) -> KafkaRecord:
        """The default routing's record: the shortest way, as most subscribers take it."""
        if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
            _refuse_unreadable(event)
        topic = self._topic
        if topic is None:
            topic = self._subscriber.topic_for(event)
        self._check_route(topic, event)
        value = self._value(event, topic)
        text = event.aggregate_id
        key = text.encode() if self._string_key else self._registry_key(topic, text)
        headers, headers_size = self._headers(event)
        size = len(key) + len(value) + headers_size
        return _record((topic, key, value, headers, size, self._free, None, None, None))

    def _routed(self, event: OutboxEvent) -> KafkaRecord:
        """The record under the subscriber's routing control: its key, its partition,
        its placements."""
        if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
            _refuse_unreadable(event)
        topic = self._topic if self._topic is not None else self._subscriber.topic_for(event)
        self._check_route(topic, event)
        routing = self._routing
        text = routing.key_text(event)
        key = text.encode() if self._string_key else self._registry_key(topic, text)
        partition = routing.partition_for(event)
        if routing.envelope:  # json only (Subscriber refuses it for the other formats)
            wrapped = {"payload": event.payload, **routing.envelope_values(event)}
            value = self._value(event._replace(payload=wrapped), topic)
        else:
            value = self._value(event, topic)
        placed = routing.header_values(event)  # the relay's own names are refused
        names = {name for name, _ in placed}  # placed over the row's header of that name
        headers = [h for h in self._headers(event)[0] if h[0] not in names]
        headers += placed
        size = len(key) + len(value) + sum(len(n) + len(v or b"") for n, v in headers)
        return KafkaRecord(topic, key, value, headers, size, self._free, partition=partition)

    def _own_record(self, event: OutboxEvent) -> KafkaRecord:
        if type(event.payload) is Unreadable or not isinstance(event.headers, dict):
            _refuse_unreadable(event)
        record = self._whole(event)
        self._check_route(record.topic, event)
        return record

    def _headers(self, event: OutboxEvent) -> tuple[list[tuple[str, str | bytes | None]], int]:
        """The record headers and their size in bytes."""
        types = self._types
        names = types.names  # compared field by field: no tuple made per event
        if names[0] != event.event_type or names[1] != event.aggregate_type:
            types = self._owner.type_headers(event.event_type, event.aggregate_type)
            self._types = types
        tx = self._tx
        if tx[0] != event.transaction_id:
            tx = _tx_header(event.transaction_id)
            self._tx = tx
        return _event_headers(event, types, tx)

    def _check_route(self, topic: str, event: OutboxEvent) -> None:
        guard = self._guard
        if guard is not None and (refusal := guard.refusal(topic, self._subscriber)):
            raise EncodingError(f"event {event.message_id}: not routed to {topic!r}: {refusal}")

    def _registry_key(self, topic: str, text: str) -> bytes:
        """An avro-registry key (only avro-registry subscribers have one, and their
        value found the registry encoder first)."""
        assert self._owner.schema_registry is not None
        return self._owner.schema_registry.encode_key(topic, text)


def _no_values(event: OutboxEvent, topic: str) -> bytes:
    raise AssertionError("a format that writes whole records writes no values")


def _tx_header(transaction_id: int) -> tuple[int, tuple[str, bytes], int]:
    """A transaction's header, and its size with its name."""
    value = b"%d" % transaction_id
    return transaction_id, (HEADER_TRANSACTION_ID, value), len(value)


def _event_headers(
    event: OutboxEvent, types: _TypeHeaders, tx: tuple[int, tuple[str, bytes], int]
) -> tuple[list[tuple[str, str | bytes | None]], int]:
    """``event``'s record headers, its type and transaction headers already made, and
    their size in bytes."""
    message_id = event.id_text or str(event.message_id).encode()
    position = b"%d" % event.position
    headers: list[tuple[str, str | bytes | None]] = [
        (HEADER_ID, message_id),
        types.event_type,
        types.aggregate_type,
        tx[1],
        (HEADER_POSITION, position),
    ]
    size = types.size + tx[2] + len(message_id) + len(position)
    if event.aggregate_version is not None or event.headers:
        size += _more_headers(event, headers)
    return headers, size


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
# Cached subscriber encoders and type headers at most (rows choose their types; subscribers reload).
_MAX_CACHED = 4096
_ID_NAMES_SIZE = len(HEADER_ID) + len(HEADER_TRANSACTION_ID) + len(HEADER_POSITION)


class _TypeHeaders(NamedTuple):
    event_type: tuple[str, bytes]
    aggregate_type: tuple[str, bytes]
    size: int  # of both, and of the names of the id, transaction id and position headers
    names: tuple[str, str]  # (event type, aggregate type): what they were made of


def _type_headers(event_type: str, aggregate_type: str) -> _TypeHeaders:
    event_type_bytes, aggregate_type_bytes = event_type.encode(), aggregate_type.encode()
    size = _ID_NAMES_SIZE + len(HEADER_EVENT_TYPE) + len(event_type_bytes)
    size += len(HEADER_AGGREGATE_TYPE) + len(aggregate_type_bytes)
    return _TypeHeaders(
        (HEADER_EVENT_TYPE, event_type_bytes),
        (HEADER_AGGREGATE_TYPE, aggregate_type_bytes),
        size,
        (event_type, aggregate_type),
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
