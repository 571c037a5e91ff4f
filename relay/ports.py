"""The worker's two ports, and the types that cross them.

A part worker reads and checkpoints events through a :class:`PartStore` (Postgres:
``relay.store.OutboxStore``) and publishes them through a :class:`Publisher` (Kafka:
``relay.kafka.TransactionalPublisher`` or ``IdempotentPublisher``). In-memory
adapters of both live in ``relay.testing``; ``tests/test_*_contract.py`` hold each
port to the same contract, whichever adapter is behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol
from uuid import UUID

from relay.key_space import KeySpace, KeySpaceCheck
from relay.model import KafkaCheckpoint, KafkaRecord, OutboxEvent, Position
from relay.subscribers import Subscriber


@dataclass(frozen=True)
class PartState:
    """One part of a subscriber as stored: its checkpoint, CAS version and owner."""

    subscriber: Subscriber
    subscriber_id: UUID
    part: int
    checkpoint: Position
    version: int
    generation: UUID
    owner: UUID | None
    halted_error: str | None
    updated_at: datetime

    @property
    def name(self) -> str:
        return self.subscriber.name


@dataclass(frozen=True)
class DeadLetterDecision:
    """A poison event goes to ``topic`` because of ``error`` (recorded in Postgres)."""

    topic: str
    error: str


class PartStore(Protocol):
    """What a part worker needs of the outbox: its part's events and checkpoint."""

    def fetch(
        self,
        after: Position,
        limit: int,
        *,
        max_bytes: int = 2**62,
        part: int = 0,
        parts: int = 1,
    ) -> list[OutboxEvent]:
        """Up to ``limit`` decided events of ``part`` after ``after``, in publication
        order, and no more once their stored payloads and headers reach ``max_bytes``
        (at least one)."""

    def get_part(self, name: str, part: int) -> PartState:
        """The part as stored; raises ``SubscriberError`` when there is none."""

    def advance(self, state: PartState, to: Position, owner: UUID) -> int:
        """Compare-and-set ``state``'s checkpoint to ``to``; returns the new version.
        Raises ``CheckpointConflict`` when the version or owner moved."""

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        """Dead-letter decisions already recorded for events in ``(after, upto]``."""

    def record_dead_letter(
        self, state: PartState, event: OutboxEvent, decision: DeadLetterDecision
    ) -> None:
        """Record a decision, so that it is never made differently later."""

    def halt(self, state: PartState, owner: UUID, error: str) -> None:
        """Halt the part with ``error``; raises ``ClaimLost`` when ``owner`` lost it."""

    def check_key_space(self) -> KeySpaceCheck | None:
        """Check (and repair) the stored keys' space; None before migration 0004."""

    def key_space(self) -> KeySpace: ...

    def key_of(self, message_id: UUID) -> Position | None:
        """The key of the event ``message_id``; None when the outbox lacks it."""

    def translate(self, key_space: UUID, key: Position) -> Position:
        """A key of ``key_space`` as a key of the space rebased from it."""

    def close(self) -> None:
        """Release the connection; the store is not used again."""


# What ``meanwhile`` may hand back: more records for the batch in flight, and its new end.
Extension = tuple[Sequence[KafkaRecord], Position]


class Publisher(Protocol):
    """Publishes batches for one subscriber part."""

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        """Take over the part: fence earlier producers, return the Kafka-side checkpoint.
        Checkpoints written from now on are tagged with ``key_space``."""

    def publish(
        self,
        records: Sequence[KafkaRecord],
        end: Position,
        generation: str,
        meanwhile: Callable[[], Extension | None] | None = None,
    ) -> None:
        """Publish ``records`` (the batch ending at ``end``); return once all are durable.

        ``meanwhile`` runs once the records are handed to the client, while they travel:
        the caller prepares its next batch there. If it returns an extension, those
        records join this batch, which then ends where the extension does.

        Raises :class:`BrokerUnavailable` (retry), :class:`PoisonRecordError` (one record's
        fault) or :class:`ProducerFenced` (another relay owns the part now).
        """

    def close(self) -> None: ...
