"""In-memory adapters of the relay's ports (``relay.ports``), for tests of the logic
above them: no Postgres, no Kafka. ``tests/contracts/`` holds them to what the real
adapters do."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from datetime import UTC, datetime
from uuid import UUID

from relay.errors import CheckpointConflict, ClaimLost, SubscriberError
from relay.key_space import KeySpace, KeySpaceAction, KeySpaceCheck
from relay.model import (
    ConsumedRecord,
    KafkaCheckpoint,
    KafkaRecord,
    OutboxEvent,
    Position,
    Unreadable,
)
from relay.ports import (
    Batch,
    DeadLetter,
    DeadLetterDecision,
    Fetched,
    Meanwhile,
    PartState,
    Progress,
    Selection,
)
from relay.subscribers import Subscriber


class InMemoryStore:
    """A :class:`relay.ports.PartStore` over lists and dicts: one outbox whose every
    event is committed (decided), and single-part subscribers.

    Set up as the Postgres store is: :meth:`add` a subscriber, :meth:`claim` its part;
    :meth:`append` stands for an application's committed transaction.
    """

    def __init__(self) -> None:
        self.events: list[OutboxEvent] = []
        self.parts: dict[tuple[str, int], PartState] = {}
        # subscriber → message id → (event key, decision)
        self.dead: dict[str, dict[UUID, tuple[Position, DeadLetterDecision]]] = {}
        self.key_space_id = uuid.uuid4()
        self.closed = False

    # -- setting up, as an application and an operator would ---------------------------

    def append(self, event: OutboxEvent) -> OutboxEvent:
        """Commit ``event``; it gets the next key, whatever key it came with, and its
        size as JSON text unless it comes with one."""
        last = self.events[-1].key if self.events else Position(100, 0)
        size = event.stored_bytes or len(json.dumps(event.payload)) + len(json.dumps(event.headers))
        committed = event._replace(
            transaction_id=last.transaction_id + 1, position=1, stored_bytes=size
        )
        self.events.append(committed)
        return committed

    def add(self, subscriber: Subscriber) -> bool:
        if subscriber.parts != 1:
            raise SubscriberError("the in-memory store holds single-part subscribers only")
        if (subscriber.name, 0) in self.parts:
            raise SubscriberError(f"subscriber {subscriber.name!r} already exists")
        self.parts[subscriber.name, 0] = PartState(
            subscriber=subscriber,
            subscriber_id=uuid.uuid4(),
            part=0,
            checkpoint=Position(0, 0),
            version=1,
            generation=uuid.uuid4(),
            owner=None,
            halted_error=None,
            updated_at=datetime.now(UTC),
        )
        return True

    def claim(self, name: str, part: int, owner: UUID) -> bool:
        state = self.parts.get((name, part))
        if state is None or state.owner not in (None, owner):
            return False
        self._set(dataclasses.replace(state, owner=owner))
        return True

    def set_paused(self, name: str, paused: bool) -> None:
        """Pause or resume (which clears a halt), bumping the version as Postgres does."""
        state = self.get_part(name, 0)
        subscriber = dataclasses.replace(state.subscriber, paused=paused)
        halted = state.halted_error if paused else None
        self._set(
            dataclasses.replace(
                state, subscriber=subscriber, version=state.version + 1, halted_error=halted
            )
        )

    # -- the port ---------------------------------------------------------------------

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        limit, max_bytes = selection.limit, selection.max_bytes
        read: list[OutboxEvent] = []
        size = 0
        for event in self.events:
            if event.key <= after:
                continue
            if len(read) == limit or (read and size >= max_bytes):
                break
            read.append(event)
            size += event.stored_bytes
        if not read:
            return Fetched([], None)
        aggregate_types, event_types = selection.aggregate_types, selection.event_types
        kept = [
            _unless_too_large(e, selection.max_row_bytes)
            for e in read
            if (aggregate_types is None or e.aggregate_type in aggregate_types)
            and (event_types is None or e.event_type in event_types)
        ]
        return Fetched(kept, read[-1].key, len(read) == limit or size >= max_bytes)

    def get_part(self, name: str, part: int) -> PartState:
        state = self.parts.get((name, part))
        if state is None:
            raise SubscriberError(f"no subscriber part {name}/{part}")
        return state

    def advance(
        self, state: PartState, to: Position, owner: UUID, dead_letters: Sequence[DeadLetter] = ()
    ) -> int:
        current = self.get_part(state.name, state.part)
        if current.version != state.version or current.owner != owner or to < current.checkpoint:
            raise CheckpointConflict(
                f"checkpoint of {state.name}/{state.part} changed underneath this relay"
            )
        recorded = self.dead.setdefault(state.name, {})
        for letter in dead_letters:
            recorded.setdefault(letter.message_id, (letter.key, letter.decision))
        return self._set(
            dataclasses.replace(current, checkpoint=to, version=current.version + 1)
        ).version

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        recorded = self.dead.get(name, {})
        return {m: d for m, (key, d) in recorded.items() if after < key <= upto}

    def halt(self, state: PartState, owner: UUID, error: str) -> None:
        current = self.get_part(state.name, state.part)
        if current.owner != owner:
            raise ClaimLost(f"{state.name}/{state.part} is no longer claimed by this relay")
        self._set(dataclasses.replace(current, halted_error=error, version=current.version + 1))

    def check_key_space(self) -> KeySpaceCheck | None:
        return KeySpaceCheck(KeySpaceAction.UNCHANGED, self.key_space_id, 0, None)

    def key_space(self) -> KeySpace:
        return KeySpace(self.key_space_id, None, None)

    def key_of(self, message_id: UUID) -> Position | None:
        return next((e.key for e in self.events if e.message_id == message_id), None)

    def translate(self, key_space: UUID, key: Position) -> Position:
        # This store is never restored elsewhere, so no key space was rebased from it.
        raise SubscriberError(f"key space {key_space} was never rebased into this store")

    def close(self) -> None:
        self.closed = True

    def _set(self, updated: PartState) -> PartState:
        updated = dataclasses.replace(updated, updated_at=datetime.now(UTC))
        self.parts[updated.name, updated.part] = updated
        return updated


class InMemoryPublisher:
    """A :class:`relay.ports.Publisher` that stands for a broker and the part's producer:
    committed transactions in a list, and the Kafka-side checkpoint of each checkpoint
    generation beside them, as the transactional publisher keeps it.

    Two hooks stand for the world around the batch in flight: ``on_send`` runs as it is
    handed to the client (before ``meanwhile``: what happens elsewhere while it
    travels), and ``refuse`` is the broker's verdict on each transaction's records (it
    raises :class:`PoisonRecordError` for those the broker would refuse).
    """

    def __init__(self) -> None:
        self.transactions: list[list[KafkaRecord]] = []
        self.checkpoints: dict[str, KafkaCheckpoint] = {}
        self.on_send: Callable[[], None] | None = None
        self.refuse: Callable[[Sequence[KafkaRecord]], None] | None = None
        self.closed = False
        self._key_space: UUID | None = None

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        self._key_space = key_space
        return self.checkpoints.get(generation)

    def publish(self, batch: Batch, meanwhile: Meanwhile | None = None) -> None:
        if self.on_send is not None:
            self.on_send()
        records, end, generation = batch.records, batch.end, batch.generation
        if records and not batch.may_extend:
            # As the real one: the batch commits as given while the callback runs.
            self._commit(records, end, generation, batch.dead_letters)
            if meanwhile is not None and meanwhile() is not None:
                raise AssertionError("meanwhile extended a batch after promising not to")
            return
        # As the real one: the callback runs while the records travel, and an
        # extension joins the transaction.
        extension = meanwhile() if meanwhile is not None else None
        if not records:  # no transaction: the Postgres checkpoint alone moves
            if extension is not None:
                self.publish(Batch(*extension, generation))
            return
        if extension is not None:
            records, end = [*records, *extension[0]], extension[1]
        self._commit(records, end, generation, batch.dead_letters)

    def _commit(
        self,
        records: Sequence[KafkaRecord],
        end: Position,
        generation: str,
        dead_letters: Sequence[tuple[str, str]],
    ) -> None:
        if self.refuse is not None:
            self.refuse(records)
        self.transactions.append(list(records))
        last = records[-1].outbox_message_id
        self.checkpoints[generation] = KafkaCheckpoint(
            end,
            self._key_space,
            UUID(last) if last else None,
            tuple((UUID(m), topic) for m, topic in dead_letters),
        )

    def close(self) -> None:
        self.closed = True

    def published(self) -> list[KafkaRecord]:
        """Every committed record, in order."""
        return [record for transaction in self.transactions for record in transaction]


class InMemoryTopicReader:
    """A :class:`relay.ports.TopicReader` of what an :class:`InMemoryPublisher`
    committed: one partition per topic, offsets counted per topic."""

    def __init__(self, broker: InMemoryPublisher) -> None:
        self._broker = broker

    def read(
        self, topics: Sequence[str], progress: Progress | None = None
    ) -> Iterator[ConsumedRecord]:
        records = self._committed(topics)
        yield from records
        if progress is not None:
            progress(len(records), len(records))

    def follow(
        self, topics: Sequence[str], idle: float = 0.1
    ) -> Generator[ConsumedRecord | None, None, None]:
        done = 0
        while True:
            records = self._committed(topics)
            if len(records) == done:
                time.sleep(idle)  # as a consumer's poll waits for one
                yield None
            yield from records[done:]
            done = len(records)

    def _committed(self, topics: Sequence[str]) -> list[ConsumedRecord]:
        offsets: dict[str, int] = {}
        records = []
        for record in self._broker.published():
            offset = offsets[record.topic] = offsets.get(record.topic, -1) + 1
            if record.topic in topics:
                records.append(_consumed(record, offset))
        return records


def _unless_too_large(event: OutboxEvent, limit: int) -> OutboxEvent:
    """``event``, or its identity only when it is larger than ``limit``, as the
    Postgres fetch returns a row too large for any record."""
    size = event.stored_bytes + sum(
        len(text.encode()) for text in (event.aggregate_type, event.aggregate_id, event.event_type)
    )
    if size <= limit:
        return event
    return event._replace(
        aggregate_type=_cut(event.aggregate_type),
        aggregate_id=_cut(event.aggregate_id),
        event_type=_cut(event.event_type),
        payload=Unreadable(f"too large to publish: the row holds {size} bytes", read=False),
        headers={},
        debezium=None,
    )


def _cut(text: str) -> str:
    size = len(text.encode())
    return text if size <= 200 else f"{text[:200]}...[cut: {size} bytes]"


def _consumed(record: KafkaRecord, offset: int) -> ConsumedRecord:
    """``record`` as a consumer reads it: header values are bytes on the wire."""
    headers = [(k, v.encode() if isinstance(v, str) else v) for k, v in record.headers]
    return ConsumedRecord(
        record.topic, 0, offset, record.key, record.value, headers, record.timestamp_ms
    )
