"""The part worker's decisions on their own, over the in-memory store and publisher of
``relay.adapters.memory``: races on the checkpoint, recovery, read-ahead, and blame for
batch-wide broker rejections. Each test runs a real worker thread until the outbox
is published, then looks at what reached Kafka and Postgres."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import KafkaCheckpoint, KafkaRecord, OutboxEvent, PartId, Position, Unreadable
from relay.core.ports import (
    Batch,
    DeadLetter,
    Fetched,
    Meanwhile,
    Owned,
    PartState,
    RelaySession,
    Selection,
)
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.engine.encoding import RecordEncoder
from relay.engine.worker import PartWorker
from relay.errors import PoisonRecordError
from tests.support import wait_until

OWNER = uuid.uuid4()
JSON = Subscriber("s", topic="t", value_format=ValueFormat.JSON)


def event(n: int, aggregate_type: str = "order", stored_bytes: int = 0) -> OutboxEvent:
    """An event as an application writes it (the store gives it its key)."""
    return OutboxEvent(
        transaction_id=0,
        position=0,
        message_id=uuid.uuid4(),
        aggregate_type=aggregate_type,
        aggregate_id=f"k{n}",
        aggregate_version=None,
        event_type="OrderPlaced",
        payload={"n": n},
        headers={},
        occurred_at=datetime.now(UTC),
        stored_bytes=stored_bytes,
    )


def claimed(subscriber: Subscriber = JSON, store: InMemoryStore | None = None) -> InMemoryStore:
    """A store whose one part is claimed by this relay's session."""
    store = store if store is not None else InMemoryStore()
    store.add(subscriber)
    store.open_session("test", 1, 3600, session_id=OWNER)
    assert store.claim(subscriber.name, 0, OWNER)
    return store


def worker(
    store: InMemoryStore,
    kafka: InMemoryPublisher,
    batch_size: int = 100,
    batch_max_bytes: int = 2**62,
) -> PartWorker:
    return PartWorker(
        PartId("s", 0),
        session=RelaySession(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: kafka,
        encoder=RecordEncoder(None),
        batch_size=batch_size,
        batch_max_bytes=batch_max_bytes,
        poll_interval=0.05,
    )


def run_until_published(w: PartWorker, store: InMemoryStore) -> None:
    """Run the worker until the part's checkpoint reaches the last event, then stop it."""
    last = store.events[-1].key
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what=f"checkpoint {last}")
    finally:
        w.stop()
        w.join(10)
    assert not w.is_alive()


def generation(store: InMemoryStore) -> str:
    return str(store.get_part("s", 0).generation)


def published_ids(kafka: InMemoryPublisher, topic: str = "t") -> list[str | None]:
    return [r.outbox_message_id for r in kafka.published() if r.topic == topic]


def ids(events: Sequence[OutboxEvent]) -> list[str | None]:
    return [str(e.message_id) for e in events]


def test_a_batch_is_recorded_once_even_if_the_version_moves_twice_meanwhile() -> None:
    store = claimed()
    written = [store.append(event(n)) for n in (1, 2)]
    kafka = InMemoryPublisher()

    def pause_and_resume() -> None:  # an operator, while the first batch travels
        if not kafka.transactions:
            store.set_paused("s", True)
            store.set_paused("s", False)

    kafka.on_send = pause_and_resume
    w = worker(store, kafka)
    run_until_published(w, store)
    assert len(kafka.transactions) == 1
    # Recorded on the spot, not after a failure and a recovery from the Kafka side.
    assert (w.stats.errors, w.stats.recovered) == (0, 0)
    assert published_ids(kafka) == ids(written)


def test_a_batch_is_published_under_the_session_s_lease() -> None:
    """The publisher asks the lease before it fences the part's producers again (an
    aborted transaction's retry): once the session is lost, the answer is no."""
    store = claimed()
    store.append(event(1))
    leases: list[Owned | None] = []

    class Leased(InMemoryPublisher):
        def publish(
            self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
        ) -> None:
            leases.append(owned)
            super().publish(batch, meanwhile, owned)

    w = worker(store, Leased())
    run_until_published(w, store)
    owned = leases[0]
    assert owned is not None and owned()
    w.session.lost.set()
    assert not owned()


def test_a_checkpoint_moved_back_in_the_same_generation_is_recovered_not_published_again() -> None:
    """A database restored (or a key space rebased) under a running worker moves its
    checkpoint back while a batch travels. The batch's Kafka-side checkpoint is adopted
    through recovery; nothing is published twice."""
    store = claimed()
    start = store.get_part("s", 0).checkpoint
    written = [store.append(event(n)) for n in range(1, 5)]
    kafka = InMemoryPublisher()
    restored: list[bool] = []

    def restore() -> None:  # while the second batch travels
        if len(kafka.transactions) == 1 and not restored:
            part = store.get_part("s", 0)
            store.parts["s", 0] = dataclasses.replace(part, checkpoint=start, version=1000)
            restored.append(True)

    kafka.on_send = restore
    w = worker(store, kafka, batch_size=2)
    run_until_published(w, store)
    assert restored
    assert published_ids(kafka) == ids(written)
    assert (w.stats.recovered, w.stats.recoveries_refused) == (1, 0)


def test_a_checkpoint_postgres_lost_while_the_part_idles_is_recovered_not_published_again() -> None:
    """Transactional delivery commits the Postgres checkpoint without waiting for the
    WAL flush: a crash of Postgres can lose the last ones, and the idle worker's next
    reload finds its checkpoint behind, in the same generation. It recovers (adopting
    Kafka's checkpoint) instead of publishing those events again."""
    store = claimed()
    first = [store.append(event(n)) for n in range(1, 5)]
    kafka = InMemoryPublisher()
    w = worker(store, kafka, batch_size=2)
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).checkpoint == first[-1].key, what="caught up")
        part = store.get_part("s", 0)  # lose the last advance: its position and its version
        store.parts["s", 0] = dataclasses.replace(
            part, checkpoint=first[1].key, version=part.version - 1
        )
        # Back at the end only once the idle worker noticed (no event wakes it).
        wait_until(lambda: store.get_part("s", 0).checkpoint == first[-1].key, what="noticed")
        later = store.append(event(5))
        w.wake()
        wait_until(lambda: store.get_part("s", 0).checkpoint == later.key, what="the later event")
    finally:
        w.stop()
        w.join(10)
    assert published_ids(kafka) == ids([*first, later])
    assert (w.stats.recovered, w.stats.recoveries_refused) == (1, 0)


def test_recovery_adopts_a_kafka_checkpoint_ahead_of_postgres() -> None:
    """The last transaction committed in Kafka, but its checkpoint never reached
    Postgres: its events are not published again."""
    store = claimed()
    written = [store.append(event(n)) for n in range(1, 6)]
    kafka = InMemoryPublisher()
    kafka.checkpoints[generation(store)] = KafkaCheckpoint(
        written[-1].key, store.key_space_id, written[-1].message_id
    )
    w = worker(store, kafka)
    run_until_published(w, store)
    assert kafka.transactions == []
    assert (w.stats.recovered, w.stats.recoveries_refused) == (1, 0)


def test_recovery_refuses_a_kafka_checkpoint_whose_last_event_is_not_in_the_outbox() -> None:
    """A restored older backup: Kafka's checkpoint names an event this database lacks,
    so what the database holds is published again rather than skipped."""
    store = claimed()
    kept = store.append(event(1))
    kafka = InMemoryPublisher()
    lost = Position(kept.transaction_id + 1, 1)  # the restore lost this transaction
    kafka.checkpoints[generation(store)] = KafkaCheckpoint(lost, store.key_space_id, uuid.uuid4())
    w = worker(store, kafka)
    run_until_published(w, store)
    assert published_ids(kafka) == ids([kept])
    assert (w.stats.recovered, w.stats.recoveries_refused) == (0, 1)


def test_a_batch_wide_rejection_blames_only_the_culprit() -> None:
    subscriber = Subscriber(
        "s", topic="t", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER
    )
    store = claimed(subscriber)
    innocent, culprit, later = (store.append(event(n)) for n in (1, 2, 3))
    kafka = InMemoryPublisher()

    def refuse(records: Sequence[KafkaRecord]) -> None:
        # The broker fails the innocent neighbour together with the culprit.
        main = [r for r in records if r.topic == "t"]
        failed = [r for r in main if r.outbox_message_id in ids([innocent, culprit])]
        if str(culprit.message_id) in [r.outbox_message_id for r in failed]:
            raise PoisonRecordError(failed[0], "too large", ambiguous=len(failed) > 1)

    kafka.refuse = refuse
    run_until_published(worker(store, kafka), store)
    assert published_ids(kafka) == ids([innocent, later])
    assert published_ids(kafka, subscriber.dead_letter_topic_name) == ids([culprit])
    assert list(store.dead["s"]) == [culprit.message_id]


class CountingStore(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.fetches = 0

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        self.fetches += 1
        return super().fetch(after, selection)


def test_a_backlog_is_published_in_full_batches_each_read_while_the_last_commits() -> None:
    store = claimed(store=CountingStore())
    written = [store.append(event(n)) for n in range(1, 6)]
    kafka = InMemoryPublisher()
    fetched_before_send: list[int] = []
    kafka.on_send = lambda: fetched_before_send.append(store.fetches)
    run_until_published(worker(store, kafka, batch_size=2), store)
    # Each batch is the one read while the one before committed, not fetched again.
    assert fetched_before_send == [1, 2, 3]
    # A full batch takes nothing more: what was read during its commit is the next
    # transaction, the short tail included.
    assert [len(tx) for tx in kafka.transactions] == [2, 2, 1]
    assert published_ids(kafka) == ids(written)


def test_when_caught_up_what_commits_meanwhile_joins_the_open_transaction() -> None:
    store = claimed()
    first = [store.append(event(n)) for n in (1, 2)]
    kafka = InMemoryPublisher()

    def commit_more() -> None:  # applications, while the first batch travels
        if not kafka.transactions:
            for n in range(3, 6):
                store.append(event(n))

    kafka.on_send = commit_more
    w = worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: w.stats.published == 5, what="five events published")
    finally:
        w.stop()
        w.join(10)
    assert [len(tx) for tx in kafka.transactions] == [5]
    assert published_ids(kafka)[:2] == ids(first)
    assert store.get_part("s", 0).checkpoint == store.events[-1].key
    assert kafka.checkpoints[generation(store)].position == store.events[-1].key


def test_a_poison_event_read_ahead_is_left_to_the_policy() -> None:
    subscriber = Subscriber(
        "s",
        topic="{aggregate_type}",
        value_format=ValueFormat.JSON,
        on_poison=PoisonPolicy.DEAD_LETTER,
    )
    store = claimed(subscriber)
    good1, good2 = store.append(event(1, "t")), store.append(event(2, "t"))
    poison = store.append(event(3, "no topic!"))  # routes to an illegal name
    good4 = store.append(event(4, "t"))
    kafka = InMemoryPublisher()
    # batch_size=2: the poison event is read ahead while the first batch travels.
    w = worker(store, kafka, batch_size=2)
    run_until_published(w, store)
    assert published_ids(kafka) == ids([good1, good2, good4])
    assert published_ids(kafka, subscriber.dead_letter_topic_name) == ids([poison])
    assert list(store.dead["s"]) == [poison.message_id]
    assert (w.stats.poisoned, w.stats.dead_lettered) == (1, 1)


class _AdvanceLog(InMemoryStore):
    """Notes, for each checkpoint written, whether it carried dead letters and whether
    it was asked to be durable."""

    def __init__(self) -> None:
        super().__init__()
        self.advances: list[tuple[bool, bool]] = []

    def advance(
        self,
        state: PartState,
        to: Position,
        owner: uuid.UUID,
        dead_letters: Sequence[DeadLetter] = (),
        *,
        durable: bool = True,
    ) -> int:
        self.advances.append((bool(dead_letters), durable))
        return super().advance(state, to, owner, dead_letters, durable=durable)


def test_only_a_checkpoint_without_dead_letters_may_be_lost() -> None:
    """A checkpoint is committed without waiting for the WAL flush in both modes (a lost
    one is adopted from Kafka, or published again at least once), but one carrying dead
    letters is durable: recovery rebuilds those of the last Kafka transaction only."""
    subscriber = Subscriber(
        "s",
        topic="{aggregate_type}",
        value_format=ValueFormat.JSON,
        on_poison=PoisonPolicy.DEAD_LETTER,
    )
    store = claimed(subscriber, _AdvanceLog())
    store.append(event(1, "t"))
    store.append(event(2, "no topic!"))  # routes to an illegal name: dead-lettered
    store.append(event(3, "t"))
    run_until_published(worker(store, InMemoryPublisher(), batch_size=1), store)
    assert store.advances == [(False, False), (True, True), (False, False)]


def test_a_batch_cut_at_batch_max_bytes_is_full_and_does_not_join_the_one_in_flight() -> None:
    store = claimed()
    written = [store.append(event(n, stored_bytes=600)) for n in range(1, 6)]
    kafka = InMemoryPublisher()
    run_until_published(worker(store, kafka, batch_max_bytes=1000), store)
    # 600, then 1,200: each batch of two reaches the cap, so it is full: what is read
    # while it commits, the fifth event alone included, is a transaction of its own.
    assert [len(tx) for tx in kafka.transactions] == [2, 2, 1]
    assert published_ids(kafka) == ids(written)


def test_a_poison_event_under_the_halt_policy_halts_the_part_before_its_batch() -> None:
    subscriber = Subscriber(
        "s", topic="{aggregate_type}", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.HALT
    )
    store = claimed(subscriber)
    store.append(event(1, "t"))
    poison = store.append(event(2, "no topic!"))  # routes to an illegal name
    store.append(event(3, "t"))
    kafka = InMemoryPublisher()
    w = run_until_halted(worker(store, kafka), store)
    halted = store.get_part("s", 0).halted_error
    assert halted is not None and str(poison.message_id) in halted
    # Nothing of the batch is published, so nothing after the poison event either.
    assert kafka.transactions == []
    assert store.get_part("s", 0).checkpoint == Position(0, 0)
    assert w.stats.poisoned == 1 and w.stats.state is WorkerState.HALTED


def test_a_dead_letter_the_broker_refuses_halts_the_part() -> None:
    subscriber = Subscriber(
        "s", topic="t", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER
    )
    store = claimed(subscriber)
    good, culprit = store.append(event(1)), store.append(event(2))
    kafka = InMemoryPublisher()

    def refuse(records: Sequence[KafkaRecord]) -> None:  # the record and its dead letter
        for record in records:
            if record.outbox_message_id == str(culprit.message_id):
                raise PoisonRecordError(record, "too large")

    kafka.refuse = refuse
    run_until_halted(worker(store, kafka), store)
    halted = store.get_part("s", 0).halted_error
    assert halted is not None and "dead-letter record rejected" in halted
    assert kafka.transactions == []
    # Issue #27: the decision is not recorded, as its record is on no topic.
    assert store.dead.get("s", {}) == {}
    assert store.get_part("s", 0).checkpoint == Position(0, 0) != good.key


def run_until_halted(w: PartWorker, store: InMemoryStore) -> PartWorker:
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).halted_error is not None, what="a halt")
        wait_until(lambda: w.stats.state is WorkerState.HALTED, what="the worker to notice")
    finally:
        w.stop()
        w.join(10)
    assert not w.is_alive()  # halted: idle until resumed, so it stops when told
    return w


DEAD_LETTERING = Subscriber(
    "s", topic="t", value_format=ValueFormat.JSON, on_poison=PoisonPolicy.DEAD_LETTER
)


def test_a_dead_letter_refused_as_too_large_goes_again_with_the_events_identity_only() -> None:
    """Issue #27: a dead-letter subscriber never halts over a row's content; a dead-letter
    topic with a low max.message.bytes gets the event's identity."""
    store = claimed(DEAD_LETTERING)
    culprit, good = store.append(event(1)), store.append(event(2))
    kafka = InMemoryPublisher()

    def refuse(records: Sequence[KafkaRecord]) -> None:
        for record in records:
            if record.outbox_message_id == str(culprit.message_id) and (
                record.topic == "t" or b'"payload"' in (record.value or b"")
            ):
                raise PoisonRecordError(record, "too large")

    kafka.refuse = refuse
    run_until_published(worker(store, kafka), store)
    assert published_ids(kafka) == ids([good])
    [letter] = [r for r in kafka.published() if r.topic != "t"]
    assert letter.outbox_message_id == str(culprit.message_id)
    assert b"the broker refused the full dead letter" in (letter.value or b"")
    assert list(store.dead["s"]) == [culprit.message_id]


def test_dead_letter_decisions_go_with_the_checkpoint_and_the_kafka_side_one() -> None:
    """Decisions are recorded with the checkpoint, after the Kafka commit; the Kafka-side
    checkpoint names them by key. (It named them by message id, 32 a transaction at
    most: 40 poison events took two transactions, issue #47.)"""
    store = claimed(DEAD_LETTERING)
    bad = [event(n, stored_bytes=1)._replace(payload=Unreadable("bad")) for n in range(40)]
    written = [store.append(e) for e in bad]
    kafka = InMemoryPublisher()
    run_until_published(worker(store, kafka), store)
    assert [len(t) for t in kafka.transactions] == [40]
    assert set(store.dead["s"]) == {e.message_id for e in written}
    named = kafka.checkpoints[generation(store)].dead_letters
    assert named == tuple((e.key, DEAD_LETTERING.dead_letter_topic_name) for e in written)


def test_recovery_records_the_dead_letters_of_the_kafka_checkpoint_it_adopts() -> None:
    """The transaction carrying a dead letter committed in Kafka, but its checkpoint (and
    so its decision) never reached Postgres: the next owner records it."""
    store = claimed(DEAD_LETTERING)
    _, poison, last = (store.append(event(n)) for n in range(3))
    kafka = InMemoryPublisher()
    kafka.checkpoints[generation(store)] = KafkaCheckpoint(
        last.key, store.key_space_id, last.message_id, ((poison.key, "dlq"),)
    )
    w = worker(store, kafka)
    run_until_published(w, store)
    assert kafka.transactions == [] and w.stats.recovered == 1
    [(key, decision)] = store.dead["s"].values()
    assert key == poison.key and decision.topic == "dlq"
    assert list(store.dead["s"]) == [poison.message_id]


def test_recovery_records_dead_letters_an_older_relay_named_by_message_id() -> None:
    """A relay before issue #47 named them by message id: a rolling upgrade's new owner
    adopting its last transaction records them all the same."""
    store = claimed(DEAD_LETTERING)
    _, poison, last = (store.append(event(n)) for n in range(3))
    kafka = InMemoryPublisher()
    kafka.checkpoints[generation(store)] = KafkaCheckpoint(
        last.key, store.key_space_id, last.message_id, (), ((poison.message_id, "dlq"),)
    )
    run_until_published(worker(store, kafka), store)
    [(key, decision)] = store.dead["s"].values()
    assert key == poison.key and decision.topic == "dlq"


def test_a_part_says_it_waits_once_it_catches_up_not_while_it_drains() -> None:
    # The commit probe looks for news only while some part waits (issue #31).
    store = claimed(store=CountingStore())
    assert isinstance(store, CountingStore)
    for n in range(5):
        store.append(event(n))
    kafka = InMemoryPublisher()
    seen: list[tuple[bool, int]] = []  # (waiting, events published) at each call
    w = PartWorker(
        PartId("s", 0),
        session=RelaySession(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: kafka,
        encoder=RecordEncoder(None),
        batch_size=1,
        poll_interval=0.01,
        on_wait=lambda: seen.append((w.waiting, len(kafka.published()))),
    )
    assert not w.waiting
    w.start()
    try:
        wait_until(lambda: len(seen) >= 1, what="the part catching up")
        fetches = store.fetches
        wait_until(lambda: store.fetches >= fetches + 3, what="idle polls")
        assert len(seen) == 1  # idle polls that find nothing do not say it again
        store.append(event(5))
        w.wake()
        wait_until(lambda: len(seen) >= 2, what="the part catching up again")
    finally:
        w.stop()
        w.join(10)
    # Told after the whole backlog (one event a batch), with the flag already up.
    assert seen == [(True, 5), (True, 6)]
