"""The relay's ports, and the types that cross them.

A part worker reads and checkpoints events through a :class:`PartStore` (Postgres:
``relay.store.OutboxStore``) and publishes them through a :class:`Publisher` (Kafka:
``relay.kafka.TransactionalPublisher`` or ``IdempotentPublisher``). What is on the
topics is read back through a :class:`TopicReader` (Kafka:
``relay.topic_reader.KafkaTopicReader``): by ``verify``, the ``dev`` live view, the
tests and the benchmarks. In-memory adapters of all three live in ``relay.testing``;
``tests/contracts/`` holds each port to the same contract, whichever adapter is behind
it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol
from uuid import UUID

from relay.key_space import KeySpace, KeySpaceCheck
from relay.model import ConsumedRecord, KafkaCheckpoint, KafkaRecord, OutboxEvent, Position
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
    """A poison event goes to ``topic`` because of ``error`` (recorded in Postgres).
    ``minimal``: its dead letter carries the event's identity only (the broker refused
    the full one)."""

    topic: str
    error: str
    minimal: bool = False


class DeadLetter(NamedTuple):
    """A dead-letter decision about the event ``message_id`` at ``key``: recorded in
    Postgres only with the checkpoint that passes it, once the Kafka transaction that
    carried its record committed (docs/design.md §7)."""

    key: Position
    message_id: UUID
    decision: DeadLetterDecision


class Fetched(NamedTuple):
    """What one fetch read: the events to publish, in order; how far the read went
    (past the rows the subscriber's filters dropped; None: nothing new was read); and
    whether it came back full, a backlog with more to read."""

    events: list[OutboxEvent]
    read_to: Position | None
    full: bool = False


@dataclass(frozen=True, slots=True)
class Selection:
    """What one fetch reads: up to ``limit`` decided events of ``part`` (of ``parts``),
    and no more once their sizes (every column the relay reads, uncompressed) reach
    ``max_bytes`` (at least one). A row larger than ``max_row_bytes`` is not read: it
    comes back as its identity, its payload :class:`relay.model.Unreadable` (poison).
    Of those, the events the type filters (None: any) drop are left out: the fetch's
    ``read_to`` goes past them."""

    limit: int
    max_bytes: int = 2**62
    part: int = 0
    parts: int = 1
    aggregate_types: frozenset[str] | None = None
    event_types: frozenset[str] | None = None
    max_row_bytes: int = 2**62


class PartStore(Protocol):
    """What a part worker needs of the outbox: its part's events and checkpoint."""

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        """The events ``selection`` picks after ``after``, in publication order."""

    def get_part(self, name: str, part: int) -> PartState:
        """The part as stored; raises ``SubscriberError`` when there is none."""

    def advance(
        self, state: PartState, to: Position, owner: UUID, dead_letters: Sequence[DeadLetter] = ()
    ) -> int:
        """Compare-and-set ``state``'s checkpoint to ``to`` and record ``dead_letters``
        (events up to ``to``), all or nothing; returns the new version. Raises
        ``CheckpointConflict`` when the version or owner moved (nothing recorded)."""

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        """Dead-letter decisions already recorded for events in ``(after, upto]`` (by a
        checkpoint that passed them before a reset moved it back)."""

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
# What the publisher runs while a batch travels (see Publisher.publish).
Meanwhile = Callable[[], Extension | None]


@dataclass(frozen=True, slots=True)
class Batch:
    """One publish: ``records`` (possibly none: every event was filtered out), the batch
    of the outbox that ends at ``end``, checkpointed under the part's ``generation``.
    ``may_extend``: whether ``meanwhile`` may grow it."""

    records: Sequence[KafkaRecord]
    end: Position
    generation: str
    may_extend: bool = True
    # The batch's dead letters: (message id, dead-letter topic). The Kafka-side
    # checkpoint carries them, so an owner that adopts it records their decisions.
    dead_letters: Sequence[tuple[str, str]] = ()


class Publisher(Protocol):
    """Publishes batches for one subscriber part."""

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        """Take over the part: fence earlier producers, return the Kafka-side checkpoint.
        Checkpoints written from now on are tagged with ``key_space``."""

    def publish(self, batch: Batch, meanwhile: Meanwhile | None = None) -> None:
        """Publish ``batch``; return once all its records are durable.

        ``meanwhile`` runs once the records are handed to the client, while they travel:
        the caller prepares its next batch there. If it returns an extension, those
        records join this batch, which then ends where the extension does. With
        ``batch.may_extend`` False the caller promises it returns None: the publisher may
        then run it while the batch commits, so the next batch's reading overlaps the
        commit's round trips too (docs/design.md §5).

        Raises :class:`BrokerUnavailable` (retry), :class:`PoisonRecordError` (one record's
        fault) or :class:`ProducerFenced` (another relay owns the part now).
        """

    def close(self) -> None: ...


# What a reader reports while it reads: (records read, records to read).
Progress = Callable[[int, int], None]


class TopicReader(Protocol):
    """Reads back what is committed on topics (read_committed), partition by partition
    from the start of the log: every record of a partition in its order."""

    def read(
        self, topics: Sequence[str], progress: Progress | None = None
    ) -> Iterator[ConsumedRecord]:
        """Every record committed to ``topics`` up to their end as of the call (a topic
        that does not exist has none); ``progress`` is told how far it got.
        Raises :class:`BrokerUnavailable` when the topics cannot be read to their end."""

    def follow(
        self, topics: Sequence[str], idle: float = 0.1
    ) -> Generator[ConsumedRecord | None, None, None]:
        """Every record committed to ``topics``, then each one as it is committed, for
        as long as the caller iterates (close the iterator to stop); None each time
        ``idle`` seconds pass without one. A topic is read once it exists."""
