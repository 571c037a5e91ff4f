"""Plain data that flows through the relay: outbox rows, positions, Kafka records."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID


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
    which key space, and the last message it published (None: an older relay wrote it)."""

    position: Position
    key_space: UUID | None = None
    message_id: UUID | None = None


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A JSON column of a row the relay could not load (an integer beyond Python's
    4,300-digit limit, nesting deeper than its recursion limit...). It stands in for the
    value so that one row's defect is that row's poison, not the whole batch's."""

    error: str

    def __str__(self) -> str:
        return f"unreadable JSON ({self.error})"


class OutboxEvent(NamedTuple):
    """One committed outbox row (a tuple: the relay builds thousands per batch, and a
    frozen dataclass costs several times more to construct)."""

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
    # The row's payload and headers as Postgres stores them (possibly compressed): what
    # the fetch counts against batch_max_bytes.
    stored_bytes: int = 0
    # What Debezium's Outbox Event Router would publish for a row copied by
    # `debezium attach` (relay/debezium_format.py); None for every other row.
    debezium: dict[str, Any] | None = None

    @property
    def key(self) -> Position:
        return Position(self.transaction_id, self.position)


class KafkaRecord(NamedTuple):
    """What is produced for one event (a tuple, as OutboxEvent: a frozen dataclass took
    a tenth of the relay's time per event just to construct)."""

    topic: str
    key: bytes | None  # None: only in the debezium format (a row without a key)
    value: bytes | None  # None: a tombstone (the debezium format only)
    headers: list[tuple[str, str | bytes | None]]
    size: int = -1  # key + value + headers in bytes, when the encoder computed it
    # The row's own fields named the topic (a template with fields): when the topic
    # does not exist and the relay may not create it, that is the row's poison.
    routed: bool = False
    timestamp_ms: int | None = None  # None: the producer's clock
    # The outbox row's message id when the first header does not carry it (the debezium
    # format's "id" header is the app's id): Kafka-side checkpoints record it.
    message_id: str | None = None

    def byte_size(self) -> int:
        if self.size >= 0:
            return self.size
        return (
            len(self.key or b"")
            + len(self.value or b"")
            + sum(len(k) + len(v or b"") for k, v in self.headers)
        )


class PartId(NamedTuple):
    """One part of a subscriber: the unit a relay claims and publishes."""

    subscriber: str
    part: int

    def __str__(self) -> str:
        return f"{self.subscriber}/{self.part}"
