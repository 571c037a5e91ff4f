"""Issue #48: faults that heal by themselves make a part wait, never halt. A row's topic
that does not exist yet (create_topics = false) and a privilege revoked from the relay's
role used to halt a 'halt' part for good; now the part waits, says why (its stats, and
its checkpoint row for `status`), and goes on by itself once the cause is fixed. Only a
'dead-letter' subscriber takes a row bound for a missing topic as poison, so that one row
cannot hold back the rest. Over the in-memory store and publisher, with a real worker."""

from __future__ import annotations

from collections.abc import Sequence

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import KafkaRecord, PartId, Position
from relay.core.ports import Fetched, Selection
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.engine.waiting import WaitRecord
from relay.errors import DatabaseUnavailable, PoisonRecordError, PrivilegeMissing, TopicMissing
from tests.support import wait_until
from tests.unit.engine.test_worker_logic import OWNER, claimed, event, ids, published_ids, worker

PART = PartId("s", 0)


def routed(policy: PoisonPolicy) -> Subscriber:
    return Subscriber("s", topic="{aggregate_type}", value_format=ValueFormat.JSON,
                      on_poison=policy)  # fmt: skip


class Broker(InMemoryPublisher):
    """A broker with create_topics = false: a row's record bound for a topic not in
    ``topics`` is refused as the Kafka adapter refuses it (a wait, for 'halt')."""

    def __init__(self, *topics: str) -> None:
        super().__init__()
        self.topics = set(topics)
        self.refuse = self._missing

    def _missing(self, records: Sequence[KafkaRecord]) -> None:
        for record in records:
            if record.topic not in self.topics:
                wait = TopicMissing(record.topic, "it does not exist and create_topics is false")
                raise PoisonRecordError(record, f"topic refused: {wait.reason}", wait=wait)


def test_a_halt_part_waits_for_its_rows_missing_topic_and_goes_on_once_it_exists() -> None:
    store = claimed(routed(PoisonPolicy.HALT))
    written = [store.append(event(1, "t")), store.append(event(2, "new")),
               store.append(event(3, "t"))]  # fmt: skip
    kafka = Broker("t")
    w = worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: store.waits.get(PART, ("", ""))[0] == "topic", what="a wait")
        assert w.stats.waiting_on == "topic" and w.stats.state is not WorkerState.HALTED
        assert "'new'" in store.waits[PART][1]
        assert store.get_part("s", 0).halted_error is None and w.stats.poisoned == 0
        assert kafka.transactions == []  # nothing after the waiting row either
        kafka.topics.add("new")  # the operator creates it
        last = written[-1].key
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what="published")
        wait_until(lambda: PART not in store.waits, what="the wait cleared")
    finally:
        w.stop()
        w.join(10)
    published = [r.outbox_message_id for r in kafka.published()]
    assert published == ids(written)  # each once, in order, with no resume
    assert w.stats.waiting_on is None and w.stats.poisoned == 0


def test_a_dead_letter_part_takes_a_row_bound_for_a_missing_topic_as_poison() -> None:
    subscriber = routed(PoisonPolicy.DEAD_LETTER)
    store = claimed(subscriber)
    first, lost, after = (store.append(event(1, "t")), store.append(event(2, "new")),
                          store.append(event(3, "t")))  # fmt: skip
    kafka = Broker("t", subscriber.dead_letter_topic_name)
    w = worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).checkpoint == after.key, what="published")
    finally:
        w.stop()
        w.join(10)
    assert published_ids(kafka) == ids([first, after])
    assert published_ids(kafka, subscriber.dead_letter_topic_name) == ids([lost])
    assert w.stats.dead_lettered == 1 and PART not in store.waits


class Revocable(InMemoryStore):
    """A store whose fetch Postgres refuses while ``revoked`` (SELECT on outbox taken)."""

    revoked = False

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        if self.revoked:
            raise PrivilegeMissing("permission denied for table outbox", sqlstate="42501")
        return super().fetch(after, selection)


def test_a_revoked_privilege_makes_a_running_part_wait_not_halt() -> None:
    store = claimed(store=Revocable())
    assert isinstance(store, Revocable)
    store.revoked = True
    written = [store.append(event(n)) for n in (1, 2)]
    kafka = InMemoryPublisher()
    w = worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: PART in store.waits, what="a wait")
        assert store.waits[PART][0] == w.stats.waiting_on == "postgres_privilege"
        assert w.is_alive() and store.get_part("s", 0).halted_error is None
        store.revoked = False  # `outbox-relay grant` again
        last = written[-1].key
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what="published")
    finally:
        w.stop()
        w.join(10)
    assert published_ids(kafka) == ids(written)
    assert w.stats.failures == 0 and w.stats.state is WorkerState.STOPPED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_is_written_on_a_change_at_most_every_interval_never_per_retry() -> None:
    store = claimed()
    clock = Clock()
    record = WaitRecord(PART, OWNER, every_s=30, clock=clock)
    record.done(lambda: store)  # the first turn clears a past owner's wait, once
    record.done(lambda: store)
    assert len(store.wait_writes) == 1
    clock.now += 30
    for _ in range(50):  # a part retrying every second
        record.waiting(lambda: store, "topic", "waiting for topic 'x'")
        clock.now += 1
    assert store.waits[PART] == ("topic", "waiting for topic 'x'")
    assert len(store.wait_writes) == 2
    record.waiting(lambda: store, "topic", "waiting for topic 'y'")  # changed, 50 s later
    record.waiting(lambda: store, "kafka_acl", "refused")  # again, too soon: not yet
    record.waiting(lambda: store, "postgres", "unreachable")  # nothing can be written
    assert store.waits[PART] == ("topic", "waiting for topic 'y'")
    assert len(store.wait_writes) == 3
    for _ in range(10):  # it flaps: each end is written at once, no new start too soon
        record.done(lambda: store)
        record.waiting(lambda: store, "topic", "waiting for topic 'y'")
        clock.now += 1
    record.done(lambda: store)
    assert PART not in store.waits and len(store.wait_writes) == 4


def test_a_wait_that_cannot_be_written_is_skipped() -> None:
    def unwritable() -> InMemoryStore:
        raise DatabaseUnavailable("no connection")

    record = WaitRecord(PART, OWNER, every_s=0)
    record.waiting(unwritable, "topic", "waiting")  # logged at DEBUG, nothing raised
    record.done(unwritable)
