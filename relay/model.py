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
    payload: Any  # decoded JSON
    headers: dict[str, Any]
    occurred_at: datetime
    # What Debezium's Outbox Event Router would publish for a row copied by
    # `debezium attach` (relay/debezium_format.py); None for every other row.
    debezium: dict[str, Any] | None = None

    @property
    def key(self) -> Position:
        return Position(self.transaction_id, self.position)


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    """What is produced for one event."""

    topic: str
    key: bytes | None  # None: only in the debezium format (a row without a key)
    value: bytes | None  # None: a tombstone (the debezium format only)
    headers: list[tuple[str, str | bytes | None]]
    size: int = -1  # key + value + headers in bytes, when the encoder computed it
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
