"""Plain data that flows through the relay: outbox rows, positions, Kafka records."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple
from uuid import UUID

# Header names the relay writes: "id" (the outbox message id) as Debezium's Outbox Event
# Router; the rest spelled out.
HEADER_ID = "id"
HEADER_EVENT_TYPE = "event_type"
HEADER_AGGREGATE_TYPE = "aggregate_type"
HEADER_TRANSACTION_ID = "transaction_id"
HEADER_POSITION = "position"
HEADER_VERSION = "aggregate_version"
# Header names the relay writes on dead letters (relay/engine/poison.py); a row's own header
# under this prefix is dropped, so no consumer can mistake it for the relay's.
RESERVED_HEADER_PREFIX = "outbox."
# The W3C trace context: a writer's span (relay.trace_headers) in a row's headers, the
# relay's span in place of it on the record it publishes (relay/observability/tracing.py).
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})


class Position(NamedTuple):
    """A point in the outbox's publication order: ``(transaction_id, position)``."""

    transaction_id: int
    position: int

    def __str__(self) -> str:
        return f"{self.transaction_id}:{self.position}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """Parse ``"<transaction_id>:<position>"``."""
        tx, sep, pos = text.partition(":")
        if not sep or not tx.isdigit() or not pos.isdigit():
            raise ValueError(f"expected TRANSACTION_ID:POSITION (two integers), got {text!r}")
        return cls(int(tx), int(pos))


BEGINNING = Position(0, 0)


class KafkaCheckpoint(NamedTuple):
    """What the last committed Kafka transaction of a part recorded: where it ended, in
    which key space, and the last message it published (None: an older relay wrote it);
    and its dead letters, whose decisions an owner that adopts the checkpoint records:
    (key in ``key_space``, dead-letter topic), or (message id, dead-letter topic) as
    relays before issue #47 named them (``named_dead_letters``)."""

    position: Position
    key_space: UUID | None = None
    message_id: UUID | None = None
    dead_letters: tuple[tuple[Position, str], ...] = ()
    named_dead_letters: tuple[tuple[UUID, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A JSON column of a row the relay could not load (an integer beyond Python's
    4,300-digit limit, nesting deeper than its recursion limit...). It stands in for the
    value so that one row's defect is that row's poison, not the whole batch's."""

    error: str
    # False: the fetch did not read the row at all (too large for any record): ``error``
    # says why, on its own.
    read: bool = True

    def __str__(self) -> str:
        return f"unreadable JSON ({self.error})" if self.read else self.error


class OutboxEvent(NamedTuple):
    """One committed outbox row (a tuple: the relay builds thousands per batch, and a
    frozen dataclass costs several times more to construct). The fetch builds it with
    tuple.__new__ and every field in order (relay/adapters/postgres/store.py): a new field goes there too."""

    transaction_id: int
    position: int
    message_id: UUID
    aggregate_type: str
    aggregate_id: str
    aggregate_version: int | None
    event_type: str
    payload: Any  # decoded JSON, or Unreadable
    headers: dict[str, Any]  # or Unreadable
    occurred_at: datetime
    # What the fetch counted of the row against batch_max_bytes: its text columns and
    # its jsonb columns uncompressed (docs/design.md §7, "Large rows").
    stored_bytes: int = 0
    # What Debezium's Outbox Event Router would publish for a row copied by
    # `debezium attach` (relay/core/formats/debezium.py); None for every other row.
    debezium: dict[str, Any] | None = None
    # The message id as UTF-8 text, as the fetch reads it (Postgres writes it in a tenth
    # of the time str(UUID) takes): the "id" header's value. None: the encoder makes it.
    id_text: bytes | None = None

    @property
    def key(self) -> Position:
        return Position(self.transaction_id, self.position)


# Where timestamptz's binary form counts from: it is microseconds since this moment.
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


class FetchedEvent(OutboxEvent):
    """An event as the fetch reads it (relay/adapters/postgres/fetch_plan.py): its
    ``message_id`` and ``occurred_at`` are kept as Postgres sends them in binary, the
    uuid's 16 bytes and the microseconds since :data:`PG_EPOCH`, and made into a UUID
    and a datetime (in UTC) only when read. The default routing's records need neither
    (the "id" header is ``id_text``), and loading them cost about a microsecond per row,
    a sixth of the relay's CPU per event (issue #53). Read through their names, the
    fields are what :class:`OutboxEvent`'s are; ``tuple(event)`` and equality see the
    raw values (:func:`occurred_micros` reads a batch's in C)."""

    __slots__ = ()

    @property
    def message_id(self) -> UUID:
        return UUID(bytes=tuple.__getitem__(self, _MESSAGE_ID))

    @property
    def occurred_at(self) -> datetime:
        return PG_EPOCH + timedelta(microseconds=tuple.__getitem__(self, _OCCURRED_AT))


_MESSAGE_ID = OutboxEvent._fields.index("message_id")
_OCCURRED_AT = OutboxEvent._fields.index("occurred_at")
# A FetchedEvent's occurred_at as read: microseconds since PG_EPOCH, with no Python
# call per event.
occurred_micros = operator.itemgetter(_OCCURRED_AT)


class KafkaRecord(NamedTuple):
    """What is produced for one event (a tuple, as OutboxEvent: a frozen dataclass took
    a tenth of the relay's time per event just to construct). The encoder builds it with
    tuple.__new__ and every field in order (relay/engine/encoding.py): a new field goes there too."""

    topic: str
    key: bytes | None  # None: only in the debezium format (a row without a key)
    value: bytes | None  # None: a tombstone (the debezium format only)
    headers: list[tuple[str, str | bytes | None]]
    size: int = -1  # key + value + headers in bytes, when the encoder computed it
    # A row's field that no filter lists named the topic: the row chose it, so the
    # publisher confines it (an existing topic must be the outbox's or allowed, a new one
    # counts against max_created_topics; issue #47), and when it does not exist and the
    # relay may not create it, that is the row's poison. False: the operator declared it.
    routed: bool = False
    timestamp_ms: int | None = None  # None: the producer's clock
    # The outbox row's message id when the "id" header does not carry it (the debezium
    # format's is the app's id): use outbox_message_id, which falls back to the header.
    message_id: str | None = None
    # The partition the subscriber's partition_by chose (relay/core/routing.py); None: the
    # producer's partitioner, by key.
    partition: int | None = None

    def header(self, name: str) -> str | bytes | None:
        """The value of the first header called ``name``; None when there is none."""
        return next((value for key, value in self.headers if key == name), None)

    @property
    def outbox_message_id(self) -> str | None:
        """The message id of the outbox row this record was made of."""
        if self.message_id is not None:
            return self.message_id
        value = self.header(HEADER_ID)
        return value.decode() if isinstance(value, bytes) else value

    def byte_size(self) -> int:
        if self.size >= 0:
            return self.size
        return (
            len(self.key or b"")
            + len(self.value or b"")
            + sum(len(k) + len(v or b"") for k, v in self.headers)
        )


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    """A record as a consumer reads it back off a topic (``relay.core.ports.TopicReader``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int | None = None

    def header(self, name: str) -> bytes | None:
        """The value of the first header called ``name``; None when there is none."""
        return next((value for key, value in self.headers if key == name), None)

    def header_text(self, name: str) -> str | None:
        value = self.header(name)
        return None if value is None else value.decode(errors="replace")

    @property
    def message_id(self) -> str | None:
        """The outbox message id; None on a record the relay did not write."""
        return self.header_text(HEADER_ID)

    @property
    def position(self) -> Position | None:
        """The event's key as its headers carry it; None on a record without them."""
        tx, pos = self.header_text(HEADER_TRANSACTION_ID), self.header_text(HEADER_POSITION)
        if tx is None or pos is None or not tx.isdigit() or not pos.isdigit():
            return None
        return Position(int(tx), int(pos))


class PartId(NamedTuple):
    """One part of a subscriber: the unit a relay claims and publishes."""

    subscriber: str
    part: int

    def __str__(self) -> str:
        return f"{self.subscriber}/{self.part}"
