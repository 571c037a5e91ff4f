"""The part worker's decisions on their own, with in-memory stand-ins for Postgres and
Kafka: races on the checkpoint, recovery, and blame for batch-wide broker rejections."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from relay.encoding import RecordEncoder
from relay.errors import CheckpointConflict
from relay.kafka import Extension, PoisonRecordError
from relay.key_space import KeySpace, KeySpaceAction, KeySpaceCheck
from relay.model import KafkaCheckpoint, KafkaRecord, OutboxEvent, PartId, Position
from relay.sessions import Session
from relay.store import DeadLetterDecision, PartState
from relay.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.worker import PartWorker, _Batch

OWNER = uuid.uuid4()


def event(position: int, key: str = "k") -> OutboxEvent:
    return OutboxEvent(
        transaction_id=100 + position,
        position=position,
        message_id=uuid.uuid4(),
        aggregate_type="order",
        aggregate_id=key,
        aggregate_version=None,
        event_type="OrderPlaced",
        payload={"n": position},
        headers={},
        occurred_at=datetime.now(UTC),
    )


class FakeStore:
    """One part's checkpoint row, with a hook to bump its version before CAS writes."""

    def __init__(self, subscriber: Subscriber) -> None:
        self.state = PartState(
            subscriber=subscriber,
            subscriber_id=uuid.uuid4(),
            part=0,
            checkpoint=Position(0, 0),
            version=0,
            generation=uuid.uuid4(),
            owner=OWNER,
            halted_error=None,
            updated_at=datetime.now(UTC),
        )
        self.bumps_before_advance = 0  # concurrent pause/resume commands
        self.dead: dict[uuid.UUID, DeadLetterDecision] = {}
        self.outbox: list[OutboxEvent] = []
        self.key_space_id = uuid.uuid4()

    def fetch(
        self, after: Position, limit: int, *, max_bytes: int, part: int, parts: int
    ) -> list[OutboxEvent]:
        batch: list[OutboxEvent] = []
        for e in (e for e in self.outbox if e.key > after):
            if len(batch) == limit or sum(b.stored_bytes for b in batch) >= max_bytes:
                break
            batch.append(e)
        return batch

    def get_part(self, name: str, part: int) -> PartState:
        return self.state

    def advance(self, state: PartState, to: Position, owner: uuid.UUID) -> int:
        if self.bumps_before_advance:
            self.bumps_before_advance -= 1
            self.state = dataclasses.replace(self.state, version=self.state.version + 1)
        if state.version != self.state.version or owner != self.state.owner:
            raise CheckpointConflict("moved")
        self.state = dataclasses.replace(self.state, checkpoint=to, version=state.version + 1)
        return self.state.version

    def dead_letters(self, name: str, after: Position, upto: Position) -> dict[Any, Any]:
        return dict(self.dead)

    def record_dead_letter(self, state: PartState, ev: OutboxEvent, d: DeadLetterDecision) -> None:
        self.dead[ev.message_id] = d

    def check_key_space(self) -> KeySpaceCheck:
        return KeySpaceCheck(KeySpaceAction.UNCHANGED, self.key_space_id, 0, None)

    def key_space(self) -> KeySpace:
        return KeySpace(self.key_space_id, None, None)

    def key_of(self, message_id: uuid.UUID) -> Position | None:
        return next((e.key for e in self.outbox if e.message_id == message_id), None)

    def translate(self, key_space: uuid.UUID, key: Position) -> Position:
        raise AssertionError("no rebase in these tests")


class FakeKafka:
    """Committed transactions, each a list of records; rejects some records together."""

    def __init__(self, checkpoint: Position | None = None) -> None:
        self.transactions: list[list[KafkaRecord]] = []
        self.checkpoint = checkpoint
        self.reject_with: dict[bytes, set[bytes]] = {}  # culprit id → ids failed with it

    def recover(
        self, generation: str, key_space: uuid.UUID | None = None
    ) -> KafkaCheckpoint | None:
        if self.checkpoint is None:
            return None
        # The last message published: proof that the checkpoint is this outbox's.
        last = self.transactions[-1][-1].headers[0][1] if self.transactions else None
        message = uuid.UUID(last.decode()) if isinstance(last, bytes) else None
        return KafkaCheckpoint(self.checkpoint, key_space, message)

    def publish(
        self,
        records: Sequence[KafkaRecord],
        end: Position,
        generation: str,
        meanwhile: Callable[[], Extension | None] | None = None,
    ) -> None:
        # As the real one: while the records travel; an extension joins the batch.
        if meanwhile is not None and (extension := meanwhile()) is not None:
            records, end = [*records, *extension[0]], extension[1]
        main = [r for r in records if r.topic == "t"]  # dead letters go elsewhere
        ids = {r.headers[0][1] for r in main}
        for culprit, companions in self.reject_with.items():
            if culprit in ids:
                failed = [r for r in main if r.headers[0][1] in companions | {culprit}]
                raise PoisonRecordError(failed[0], "too large", ambiguous=len(failed) > 1)
        self.transactions.append(list(records))
        self.checkpoint = end

    def close(self) -> None: ...


def worker(
    store: FakeStore, kafka: FakeKafka, batch_size: int = 100, batch_max_bytes: int = 2**62
) -> PartWorker:
    return PartWorker(
        PartId("s", 0),
        session=Session(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,  # type: ignore[arg-type,return-value]
        open_publisher=lambda state: kafka,
        encoder=RecordEncoder(None),
        batch_size=batch_size,
        batch_max_bytes=batch_max_bytes,
        poll_interval=0.1,
    )


def published_ids(kafka: FakeKafka) -> list[bytes]:
    return [r.headers[0][1] for tx in kafka.transactions for r in tx if r.topic == "t"]  # type: ignore[misc]


def test_a_batch_is_recorded_once_even_if_the_version_moves_twice_meanwhile() -> None:
    store, kafka = FakeStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON)), FakeKafka()
    w = worker(store, kafka)
    w._publisher = kafka
    events = [event(1), event(2)]
    store.bumps_before_advance = 2  # pause, then resume, while the batch was in flight
    state, _ = w._publish(store, store.state, _Batch(events))  # type: ignore[arg-type]
    assert state.checkpoint == events[-1].key == store.state.checkpoint
    assert len(kafka.transactions) == 1


def test_recovery_adopts_a_kafka_checkpoint_ahead_of_postgres() -> None:
    store = FakeStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON))
    kafka = FakeKafka(checkpoint=Position(105, 5))
    w = worker(store, kafka)
    state = w._recover(store, store.state, store.key_space())  # type: ignore[arg-type]
    assert state.checkpoint == Position(105, 5) == store.state.checkpoint
    assert w.stats.recovered == 1


def test_recovery_refuses_a_kafka_checkpoint_whose_last_event_is_not_in_the_outbox() -> None:
    """A restored older backup: Kafka's checkpoint names an event this database lacks."""
    store = FakeStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON))
    kafka = FakeKafka()
    store.outbox = [event(1), event(2)]
    w = worker(store, kafka)
    w._publisher = kafka
    w._publish(store, store.state, _Batch(list(store.outbox)))  # type: ignore[arg-type]
    store.outbox = store.outbox[:1]  # the restore lost the second event's transaction
    store.state = dataclasses.replace(store.state, checkpoint=Position(0, 0))
    state = w._recover(store, store.state, store.key_space())  # type: ignore[arg-type]
    assert state.checkpoint == Position(0, 0)
    assert (w.stats.recovered, w.stats.recoveries_refused) == (0, 1)


def test_a_batch_wide_rejection_blames_only_the_culprit() -> None:
    subscriber = Subscriber(
        "s", topic="t", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER
    )
    store, kafka = FakeStore(subscriber), FakeKafka()
    w = worker(store, kafka)
    w._publisher = kafka
    innocent, culprit, later = event(1), event(2), event(3)
    ids = [str(e.message_id).encode() for e in (innocent, culprit, later)]
    # The broker fails the innocent neighbour together with the culprit.
    kafka.reject_with = {ids[1]: {ids[0]}}
    w._publish(store, store.state, _Batch([innocent, culprit, later]))  # type: ignore[arg-type]
    assert published_ids(kafka) == [ids[0], ids[2]]
    assert list(store.dead) == [culprit.message_id]
    assert store.state.checkpoint == later.key


def test_a_backlog_is_read_and_encoded_while_the_last_batch_travels() -> None:
    store, kafka = FakeStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON)), FakeKafka()
    w = worker(store, kafka, batch_size=2)
    w._publisher = kafka
    store.outbox = [event(n) for n in range(1, 6)]
    state, ahead = w._publish(store, store.state, _Batch(store.outbox[:2]))  # type: ignore[arg-type]
    assert ahead is not None and ahead.events == store.outbox[2:4]  # a full batch: kept
    assert ahead.records is not None and len(ahead.records) == 2
    state, ahead = w._publish(store, state, ahead)  # type: ignore[arg-type]
    # The last event was read ahead as a short batch (caught up): it joined the second
    # transaction instead of waiting for a third.
    assert [len(tx) for tx in kafka.transactions] == [2, 3]
    assert published_ids(kafka) == [str(e.message_id).encode() for e in store.outbox]
    assert state.checkpoint == store.outbox[-1].key and ahead is None


def test_when_caught_up_what_commits_meanwhile_joins_the_open_transaction() -> None:
    store, kafka = FakeStore(Subscriber("s", topic="t", value_format=ValueFormat.JSON)), FakeKafka()
    w = worker(store, kafka)
    w._publisher = kafka
    store.outbox = [event(n) for n in range(1, 6)]
    state, ahead = w._publish(store, store.state, _Batch(store.outbox[:2]))  # type: ignore[arg-type]
    assert [len(tx) for tx in kafka.transactions] == [5]
    assert published_ids(kafka) == [str(e.message_id).encode() for e in store.outbox]
    assert state.checkpoint == store.outbox[-1].key == store.state.checkpoint
    assert kafka.checkpoint == store.outbox[-1].key and ahead is None
    assert w.stats.published == 5


def test_a_poison_event_read_ahead_is_left_to_the_policy() -> None:
    subscriber = Subscriber(
        "s",
        topic="{aggregate_type}",
        value_format=ValueFormat.JSON,
        on_poison=PoisonPolicy.DEAD_LETTER,
    )
    store, kafka = FakeStore(subscriber), FakeKafka()
    w = worker(store, kafka)
    w._publisher = kafka
    good = [event(n)._replace(aggregate_type="t") for n in (1, 2, 4)]
    poison = event(3)._replace(aggregate_type="no topic!")  # routes to an illegal name
    store.outbox = [good[0], good[1], poison, good[2]]
    state, ahead = w._publish(store, store.state, _Batch(store.outbox[:2]))  # type: ignore[arg-type]
    assert ahead is not None and ahead.records is None  # not encoded: the slow path decides
    assert not store.dead  # nothing was decided while the first batch was in flight
    w._publish(store, state, ahead)  # type: ignore[arg-type]
    assert list(store.dead) == [poison.message_id]
    assert len(published_ids(kafka)) == 3
