"""The transactional publisher's fast path and its diagnosis, against a stand-in client.

Records are produced without a delivery report each; a failed record makes the commit
fail, and the batch is run again with reports to name the record at fault. A stand-in
client makes each case exact; ``test_exactly_once.py`` has the same path against
Apache Kafka refusing a record over a topic's ``max.message.bytes``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

import relay.adapters.kafka.kafka
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups, read_committed
from relay.adapters.kafka.kafka import TopicCreator, TransactionalPublisher
from relay.adapters.kafka.publishers import PublisherFactory
from relay.core.log_sampling import SampledLog
from relay.core.model import KafkaRecord, Position
from relay.core.ports import Batch
from relay.core.settings import Settings
from relay.core.subscribers import TopicGuard
from relay.errors import (
    AclRefused,
    BrokerUnavailable,
    PoisonRecordError,
    ProducerFenced,
    RelayError,
)
from tests.support import without_cyclic_collector


class FakeMessage:
    """A delivery report as confluent-kafka gives one: topic, key and value, no headers."""

    def __init__(self, record: KafkaRecord) -> None:
        self._record = record

    def topic(self) -> str:
        return self._record.topic

    def key(self) -> bytes | None:
        return self._record.key

    def value(self) -> bytes | None:
        return self._record.value

    def headers(self) -> None:
        return None


class FakeProducer:
    """Fails a record whose value is in ``reject`` (``times`` times, then accepts it)."""

    def __init__(self, reject: bytes, times: int = 1_000) -> None:
        self.reject, self.times = reject, times
        self.epoch = 0  # init_transactions calls after the first (a new client's epoch)
        self.pending: list[tuple[KafkaRecord, Any]] = []
        self.flushed: list[bytes] = []
        self.failed = False
        self.committed: list[list[bytes]] = []
        self.reports_asked = 0

    def begin_transaction(self) -> None:
        self.pending, self.flushed, self.failed = [], [], False

    def produce(self, topic: str, value: bytes, key: bytes, headers: Any, **kw: Any) -> None:
        callback = kw.get("on_delivery")
        self.reports_asked += callback is not None
        self.pending.append((KafkaRecord(topic, key, value, headers), callback))

    def flush(self, timeout: float = 0) -> int:
        for record, callback in self.pending:
            error = None
            if record.value == self.reject and self.times > 0:
                self.times -= 1
                self.failed = True
                error = KafkaError(KafkaError.INVALID_RECORD)
            if callback is not None:
                callback(error, FakeMessage(record))  # type: ignore[arg-type]
        self.flushed += [r.value for r, _ in self.pending]
        self.pending = []
        return 0

    def send_offsets_to_transaction(self, *args: Any) -> None: ...

    def commit_transaction(self, timeout: float) -> None:
        self.flush()
        if self.failed:
            raise KafkaException(KafkaError(KafkaError._STATE, txn_requires_abort=True))
        self.committed.append(self.flushed)

    def abort_transaction(self, timeout: float) -> None:
        self.pending, self.failed = [], False

    def init_transactions(self, timeout: float) -> None:
        self.epoch += 1


def topic_t_exists() -> TopicCreator:
    """Without creation, and topic "t" there already: no admin client is reached."""
    creator = TopicCreator({}, enabled=False)
    creator._admin = lambda: None  # type: ignore[method-assign,assignment,return-value]
    creator._existing = lambda admin: {"t"}  # type: ignore[method-assign]
    return creator


def publisher(producer: FakeProducer, delivery_timeout_s: float = 5.0) -> TransactionalPublisher:
    pub = TransactionalPublisher(
        {"bootstrap.servers": "127.0.0.1:1"},
        topic_t_exists(),
        delivery_timeout_s,
        transactional_id="t",
        transaction_timeout_s=10.0,
        group_prefix="g",
        checkpoint_topic="c",
        groups=CheckpointGroups({"bootstrap.servers": "127.0.0.1:1"}),
    )
    pub._producer = producer  # type: ignore[assignment]
    # A new client of the id (after an abort) is this stand-in again, at its next epoch.
    pub._new_producer = lambda: producer  # type: ignore[method-assign,assignment,return-value]
    pub._initialised = True  # recover() needs a broker; not what is tested here
    return pub


def records(*values: bytes) -> list[KafkaRecord]:
    return [KafkaRecord("t", b"k", v, [("id", v)]) for v in values]


def test_a_rejected_record_is_named_after_the_commit_fails() -> None:
    producer = FakeProducer(reject=b"bad")
    with pytest.raises(PoisonRecordError) as caught:
        publisher(producer).publish(Batch(records(b"a", b"bad", b"c"), Position(1, 1), "gen"))
    assert caught.value.record.value == b"bad"
    assert producer.committed == []  # nothing became visible
    assert producer.reports_asked == 3  # only the diagnosing run asked for reports


def test_a_passing_failure_commits_the_batch_once() -> None:
    producer = FakeProducer(reject=b"b", times=1)
    publisher(producer).publish(Batch(records(b"a", b"b"), Position(1, 1), "gen"))
    assert producer.committed == [[b"a", b"b"]]


def test_the_retry_after_an_abort_runs_at_a_new_epoch() -> None:
    """At the aborted transaction's epoch, a record the client re-sends under its old
    sequence number is taken by the broker for the aborted batch and never appended."""
    producer = FakeProducer(reject=b"b", times=1)
    epochs: list[int] = []
    commit = producer.commit_transaction

    def commit_noting_the_epoch(timeout: float) -> None:
        epochs.append(producer.epoch)
        commit(timeout)

    producer.commit_transaction = commit_noting_the_epoch  # type: ignore[method-assign]
    publisher(producer).publish(Batch(records(b"a", b"b"), Position(1, 1), "gen"))
    assert epochs == [0, 1] and producer.committed == [[b"a", b"b"]]


def test_a_relay_whose_session_lapsed_does_not_fence_the_part_again_after_an_abort() -> None:
    """The retry's new epoch fences every producer of the part, a peer's that took it
    over included: a relay that lost the part meanwhile (a SIGSTOP, a cut) would publish
    the batch the peer has published already (CI's chaos test: 50 events twice)."""
    producer = FakeProducer(reject=b"b", times=1)
    with pytest.raises(ProducerFenced, match="session lapsed"):
        publisher(producer).publish(
            Batch(records(b"a", b"b"), Position(1, 1), "gen"), owned=lambda: False
        )
    assert producer.epoch == 0 and producer.committed == []
    producer = FakeProducer(reject=b"b", times=1)
    publisher(producer).publish(
        Batch(records(b"a", b"b"), Position(1, 1), "gen"), owned=lambda: True
    )
    assert producer.epoch == 1 and producer.committed == [[b"a", b"b"]]


def test_the_fast_path_asks_for_no_delivery_reports() -> None:
    producer = FakeProducer(reject=b"never")
    publisher(producer).publish(Batch(records(b"a", b"b", b"c"), Position(1, 1), "gen"))
    assert producer.committed == [[b"a", b"b", b"c"]] and producer.reports_asked == 0


class HangingProducer(FakeProducer):
    """commit_transaction ignores its timeout and never returns (librdkafka #5511)."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.release = threading.Event()

    def commit_transaction(self, timeout: float) -> None:
        self.release.wait()


def test_a_call_that_outlives_its_timeout_abandons_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay.adapters.kafka.kafka, "_CALL_GRACE_S", 0.2)
    producer = HangingProducer()
    pub = publisher(producer)
    pub._call_timeout_s = 0.1
    try:
        with pytest.raises(ProducerFenced, match="did not return within"):
            pub.publish(Batch(records(b"a"), Position(1, 1), "gen"))
        # Abandoned: no further call reaches it, and closing does not flush it.
        with pytest.raises(ProducerFenced, match="abandoned"):
            pub.publish(Batch(records(b"b"), Position(1, 2), "gen"))
        pub.close()
    finally:
        producer.release.set()
    assert producer.committed == []


class TimeoutRecordingProducer(FakeProducer):
    """Records the timeout each transactional call is given."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.timeouts: list[float] = []

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.timeouts.append(args[-1])

    def commit_transaction(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        super().commit_transaction(timeout)


def test_each_transactional_call_waits_far_less_than_the_delivery_timeout() -> None:
    # A call librdkafka leaves hanging when its coordinator moves is given up after its
    # own timeout plus a grace period: that must be seconds, not the delivery timeout
    # (30 s by default), or one coordinator moving stalls a part for most of a minute.
    producer = TimeoutRecordingProducer()
    pub = publisher(producer, delivery_timeout_s=30.0)
    pub.publish(Batch(records(b"a"), Position(1, 1), "gen"))
    assert producer.committed == [[b"a"]]
    assert len(producer.timeouts) == 2
    # Within the 15 s a part may stall when one node dies (#29), a hung call and a new
    # producer's start must both fit: 6 s at most for the first.
    assert all(t + relay.adapters.kafka.kafka._CALL_GRACE_S <= 6.0 for t in producer.timeouts), (
        producer.timeouts
    )


def test_closing_waits_for_no_record_of_a_failed_transaction() -> None:
    # The broker that leads their partition died: the commit failed, records are still
    # queued. They can never become visible (the next producer's init_transactions
    # aborts their transaction), so closing must not wait up to 5 s for them.
    producer = FakeProducer(reject=b"never")
    pub = publisher(producer)
    producer.begin_transaction()
    producer.produce("t", b"queued", b"k", [])
    flushed: list[float] = []

    def flush(timeout: float = 0) -> int:
        flushed.append(timeout)
        return 1

    producer.flush = flush  # type: ignore[method-assign]
    pub.close()
    assert flushed == []


def test_producers_retry_a_restarted_broker_within_a_second() -> None:
    # librdkafka's default backs off up to 10 s from a broker that was down; after a
    # rolling restart that broker leads again and its partitions waited that long.
    config = relay.adapters.kafka.kafka.producer_config("b:1", {}, 30_000)
    assert config["reconnect.backoff.max.ms"] <= 1000
    assert (
        relay.adapters.kafka.kafka.producer_config("b:1", {"reconnect.backoff.max.ms": 5000}, 1)[
            "reconnect.backoff.max.ms"
        ]
        == 5000
    )  # the operator's setting wins


@pytest.mark.parametrize(("delivery", "linger_ms"), [("idempotent", 0), ("transactional", 5)])
def test_a_part_s_producer_lingers_only_when_its_commit_flushes(
    delivery: str, linger_ms: int
) -> None:
    """An idempotent batch's records are visible once acknowledged, so they go at once;
    a transaction's only at its commit, which flushes them anyway. The operator's
    ``linger.ms`` wins in both modes."""
    for overrides, expected in (({}, linger_ms), ({"linger.ms": 20}, 20)):
        settings = Settings(bootstrap_servers="b:1", delivery=delivery, kafka=overrides)
        factory = PublisherFactory(settings, TopicGuard(settings.checkpoint_topic), None)
        state = SimpleNamespace(name="s", part=0, subscriber_id=1)
        publisher = factory(state)  # type: ignore[arg-type]
        # A transactional part's publisher takes turns between two producers.
        producers = (
            [publisher._first, publisher._second]  # type: ignore[attr-defined]
            if delivery == "transactional"
            else [publisher]
        )
        assert {p._config["linger.ms"] for p in producers} == {expected}
        for p in producers:
            p.close()


@pytest.mark.parametrize(
    ("settings", "transaction_ms", "message_ms"),
    [
        ({}, 10_000, 10_000),  # the defaults: session_timeout 10 s, delivery_timeout 30 s
        ({"session_timeout": 6.0}, 10_000, 10_000),  # never below 10 s: a batch must fit
        ({"session_timeout": 40.0, "heartbeat_interval": 2.0}, 40_000, 30_000),
        ({"session_timeout": 3600.0}, 900_000, 30_000),  # the brokers' default cap
        ({"session_timeout": 20.0, "kafka": {"delivery.timeout.ms": 60_000}}, 20_000, 20_000),
        ({"kafka": {"socket.timeout.ms": 60_000, "message.timeout.ms": 5_000}}, 10_000, 5_000),
    ],
)
def test_a_transaction_times_out_with_the_session_not_a_minute_later(
    settings: dict[str, Any], transaction_ms: int, message_ms: int
) -> None:
    """Issue #49: a relay cut off from Kafka left its transaction open for the old
    max(60 s, 3 x delivery_timeout), and the last stable offset of the partitions it
    wrote stayed there: a healthy peer's records were invisible to read_committed
    readers. librdkafka refuses a record or socket timeout beyond the transaction's."""
    factory = PublisherFactory(
        s := Settings(bootstrap_servers="b:1", **settings), TopicGuard(s.checkpoint_topic), None
    )
    publisher = factory(SimpleNamespace(name="s", part=0, subscriber_id=1))  # type: ignore[arg-type]
    for producer in (publisher._first, publisher._second):  # type: ignore[attr-defined]
        config = producer._config
        assert config["transaction.timeout.ms"] == transaction_ms
        assert config["message.timeout.ms"] == message_ms
        assert config.get("delivery.timeout.ms", message_ms) == message_ms
        assert config.get("socket.timeout.ms", 0) <= transaction_ms
        producer.close()


def test_producers_keep_one_request_in_flight_whatever_the_settings_say() -> None:
    # With more in flight, a batch refused "not leader" by a partition just created was
    # counted delivered once a later batch succeeded, and a transaction committed without
    # its records (seen in CI: 98 of 100 events on the topic, every checkpoint past them).
    for overrides in ({}, {"max.in.flight.requests.per.connection": 5}):
        config = relay.adapters.kafka.kafka.producer_config("b:1", overrides, 30_000)
        assert config["max.in.flight.requests.per.connection"] == 1
        assert (config["enable.idempotence"], config["acks"]) == (True, "all")
    # librdkafka takes it with idempotence and transactions on.
    Producer({**config, "transactional.id": "t"})


class WarmingGroup:
    """A consumer whose group coordinator answers ``errors`` first (per partition),
    then the committed offsets."""

    def __init__(self, errors: list[int]) -> None:
        self.errors = errors
        self.asked = 0

    def committed(self, wanted: list[Any], timeout: float) -> list[Any]:
        self.asked += 1
        error = KafkaError(self.errors.pop(0)) if self.errors else None
        offset = -1001 if error else 7
        return [
            SimpleNamespace(partition=tp.partition, offset=offset, error=error) for tp in wanted
        ]


def test_a_coordinator_warming_up_is_asked_again_for_the_checkpoint() -> None:
    """Issue #28 (found running the README's `dead-letters redrive` on a new cluster):
    a group coordinator that is loading answers NOT_COORDINATOR or
    COORDINATOR_LOAD_IN_PROGRESS for a few seconds; reading the Kafka-side checkpoint
    failed on it at once ("cannot read the Kafka-side checkpoint: Not coordinator")."""
    from confluent_kafka import TopicPartition

    wanted = [TopicPartition("checkpoints", p) for p in range(2)]
    group = WarmingGroup([KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS])
    committed = read_committed(group, wanted, 30.0)  # type: ignore[arg-type]
    assert [tp.offset for tp in committed] == [7, 7] and group.asked == 3
    refused = WarmingGroup([KafkaError.GROUP_AUTHORIZATION_FAILED])
    with pytest.raises(RelayError, match="cannot read the Kafka-side checkpoint"):
        read_committed(refused, wanted, 30.0)  # type: ignore[arg-type]
    assert refused.asked == 1


def test_a_checkpoint_read_that_fails_leaves_no_cycle_holding_its_caller() -> None:
    """Raised, a failure's traceback holds the reading frame and, through it, the
    caller's (a part's publisher and its clients' threads): a cycle there kept closed
    producers until the cyclic collector, rare in a relay (#53)."""
    from confluent_kafka import TopicPartition

    class Caller:
        def read(self) -> None:
            refused = WarmingGroup([KafkaError.GROUP_AUTHORIZATION_FAILED])
            read_committed(refused, [TopicPartition("c", 0)], 30.0)  # type: ignore[arg-type]

    with without_cyclic_collector():
        caller = Caller()
        gone = weakref.ref(caller)
        with pytest.raises(RelayError):
            caller.read()
        del caller
        assert gone() is None


def test_a_checkpoint_group_s_metadata_is_made_once_per_group_without_a_broker() -> None:
    """The metadata a transaction commits a group's offsets with, as a consumer of the
    group gives it, made without a broker (so no client thread reaches the network),
    once per group, and shared by a part's two producers."""
    groups = CheckpointGroups({"bootstrap.servers": "127.0.0.1:1"})
    made = groups.metadata("outbox-relay.s.0.1")
    assert groups.metadata("outbox-relay.s.0.1") is made
    consumer = Consumer({"group.id": "outbox-relay.s.0.1", "bootstrap.servers": "127.0.0.1:1"})
    try:
        assert made == consumer.consumer_group_metadata()
    finally:
        consumer.close()
    assert groups.metadata("outbox-relay.s.0.2") != made


class CoordinatorLostProducer(FakeProducer):
    """send_offsets_to_transaction first meets its transaction coordinator gone (the
    broker was killed): a retriable transport error."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.offsets_sent = 0

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.offsets_sent += 1
        if self.offsets_sent == 1:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, retriable=True))


def test_a_coordinator_lost_mid_transaction_starts_the_part_over() -> None:
    # Made again on the same producer, the call hung for the watchdog's whole bound in
    # node kills (#29); the worker starts over with a new producer instead.
    producer = CoordinatorLostProducer()
    with pytest.raises(BrokerUnavailable) as raised:
        publisher(producer).publish(Batch(records(b"a"), Position(1, 1), "gen"))
    assert producer.offsets_sent == 1 and producer.committed == []
    assert raised.value.code == KafkaError._TRANSPORT


class AbortTimesOutProducer(FakeProducer):
    """The group coordinator moved mid-transaction (abortable), and the abort then times
    out: librdkafka keeps it in progress, and refuses a new transaction meanwhile."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.begun = 0

    def begin_transaction(self) -> None:
        self.begun += 1
        if self.begun > 1:
            raise KafkaException(KafkaError(KafkaError._CONFLICT, "abort already in progress"))
        super().begin_transaction()

    def send_offsets_to_transaction(self, *args: Any) -> None:
        error = KafkaError(KafkaError.NOT_COORDINATOR, retriable=True, txn_requires_abort=True)
        raise KafkaException(error)

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, retriable=True))


def test_a_producer_whose_abort_failed_takes_no_more_transactions() -> None:
    producer = AbortTimesOutProducer()
    # The abort's own failure is read by the classifier, like any transactional call's.
    with pytest.raises(
        BrokerUnavailable, match=r"could not abort the transaction \(transaction failed: "
    ):
        publisher(producer).publish(Batch(records(b"a"), Position(1, 1), "gen"))
    assert producer.begun == 1 and producer.committed == []


class ThreadRecordingProducer(FakeProducer):
    """Records the thread each transactional call runs on (the objects, whose identity,
    unlike a thread's id, is never reused)."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.threads: dict[str, list[threading.Thread]] = {"begin": [], "bounded": []}

    def begin_transaction(self) -> None:
        self.threads["begin"].append(threading.current_thread())
        super().begin_transaction()

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.threads["bounded"].append(threading.current_thread())

    def commit_transaction(self, timeout: float) -> None:
        self.threads["bounded"].append(threading.current_thread())
        super().commit_transaction(timeout)


def test_transactional_calls_start_no_thread_per_call() -> None:
    # Issue #31: a thread started per call cost ~0.25 ms each, three a transaction. Every
    # call of a transaction, begin_transaction included (librdkafka waits on its own
    # main thread for it without a bound), shares one call thread for the producer's life.
    producer = ThreadRecordingProducer()
    pub = publisher(producer)
    for n in range(3):
        pub.publish(Batch(records(b"a"), Position(1, n + 1), "gen"))
    pub.close()
    assert len(producer.committed) == 3
    calls = producer.threads["begin"] + producer.threads["bounded"]
    assert len(calls) == 9 and len(set(calls)) == 1, set(calls)
    assert threading.current_thread() not in calls


def test_closing_a_publisher_ends_its_call_thread() -> None:
    # The pool closes idle parts' publishers so that an idle relay holds no threads.
    producer = ThreadRecordingProducer()
    pub = publisher(producer)
    pub.publish(Batch(records(b"a"), Position(1, 1), "gen"))
    (thread,) = set(producer.threads["bounded"])
    pub.close()
    thread.join(10.0)  # a wait for the thread's end, not a measure of it
    assert not thread.is_alive()


def test_a_hung_call_keeps_its_thread_and_the_next_producer_gets_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay.adapters.kafka.kafka, "_CALL_GRACE_S", 0.2)
    hanging = HangingProducer()
    stuck = publisher(hanging)
    stuck._call_timeout_s = 0.1
    hung_on: list[threading.Thread] = []
    release = hanging.release

    def commit_transaction(timeout: float) -> None:
        hung_on.append(threading.current_thread())
        release.wait()

    hanging.commit_transaction = commit_transaction  # type: ignore[method-assign]
    try:
        with pytest.raises(ProducerFenced, match="did not return within"):
            stuck.publish(Batch(records(b"a"), Position(1, 1), "gen"))
        stuck.close()
        # The part starts over with a new producer: its calls do not queue behind the
        # hung one, they run on a thread of its own.
        fresh = ThreadRecordingProducer()
        publisher(fresh).publish(Batch(records(b"b"), Position(1, 2), "gen"))
        assert fresh.committed == [[b"b"]]
        assert hung_on[0] not in set(fresh.threads["bounded"])
        assert hung_on[0].is_alive()  # still blocked in librdkafka: abandoned, not reused
    finally:
        release.set()
    hung_on[0].join(10.0)  # closed: it ends once the hung call returns
    assert not hung_on[0].is_alive()
    assert hanging.committed == []


class AclRefusingProducer(FakeProducer):
    """A transaction adding a topic the principal may not write: the client fails the
    transaction, purges its records, and answers transactional calls with its error."""

    def __init__(self) -> None:
        super().__init__(reject=b"")
        self.txn_failed = False

    def begin_transaction(self) -> None:
        if self.txn_failed:
            raise KafkaException(
                KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed",
                           txn_requires_abort=True)
            )  # fmt: skip
        super().begin_transaction()

    def flush(self, timeout: float = 0) -> int:
        for record, callback in self.pending:
            if callback is not None:
                callback(KafkaError(KafkaError._PURGE_QUEUE), FakeMessage(record))  # type: ignore[arg-type]
        self.pending, self.txn_failed = [], True
        return 0

    def commit_transaction(self, timeout: float) -> None:
        self.flush()  # the commit saw the failed state only, not why
        raise KafkaException(KafkaError(KafkaError._STATE, txn_requires_abort=True))

    def abort_transaction(self, timeout: float) -> None:
        self.pending, self.txn_failed = [], False


def test_records_purged_by_a_transaction_an_acl_failed_name_the_acl() -> None:
    """Issue #48: the retry with delivery reports saw only "Purged in queue", so a part
    waiting for an ACL showed as waiting for Kafka."""
    with pytest.raises(AclRefused) as caught:
        publisher(AclRefusingProducer()).publish(Batch(records(b"a"), Position(1, 1), "gen"))
    assert caught.value.waits_on == "kafka_acl" and "Topic authorization failed" in str(
        caught.value
    )


def test_slow_calls_say_so_at_info_once_a_minute_then_count_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loaded relay's transaction calls pass a second every few seconds (issue #52:
    an INFO line every ~2 s): each is at DEBUG; INFO has the first of the minute and a
    count of the others."""
    now = [0.0]
    sampled = SampledLog(
        relay.adapters.kafka.kafka.logger,
        "%d more took long in %.0fs",
        lambda count: {"calls": count},
        first=1,
        level=logging.INFO,
        clock=lambda: now[0],
    )
    monkeypatch.setattr(relay.adapters.kafka.kafka, "_SLOW_CALLS", sampled)
    caplog.set_level(logging.DEBUG, logger="relay.adapters.kafka.kafka")
    pub = publisher(FakeProducer(reject=b"none"))
    for _ in range(5):
        pub._log_if_slow(pub._producer.commit_transaction, 1.5, "")
        now[0] += 2.0
    now[0] = 61.0
    pub._log_if_slow(pub._producer.commit_transaction, 1.2, "")
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == [
        "t: commit_transaction took 1.5s",
        "4 more took long in 61s",
        "t: commit_transaction took 1.2s",
    ]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4


class RefusingInit(FakeProducer):
    """``init_transactions`` fails ``refusals`` times with ``code``, then succeeds."""

    def __init__(self, code: int, refusals: int) -> None:
        super().__init__(b"-")
        self.code, self.refusals = code, refusals

    def init_transactions(self, timeout: float) -> None:
        if self.refusals:
            self.refusals -= 1
            raise KafkaException(KafkaError(self.code, "refused", retriable=True))


@pytest.mark.parametrize(
    ("code", "refusals"),
    [(KafkaError.CONCURRENT_TRANSACTIONS, 1), (KafkaError.INVALID_CONFIG, 1_000)],
    ids=["retried", "raised"],
)
def test_a_failed_call_leaves_no_cycle_holding_the_closed_publisher(
    code: int, refusals: int
) -> None:
    # Held in a cycle through the failure's traceback, a closed publisher and its
    # client's threads lived until the cyclic collector ran, rarely in a relay
    # (tune_gc): 1,000 parts reopening producers ran hundreds of clients (issue #53).
    with without_cyclic_collector():
        pub = publisher(RefusingInit(code, refusals))
        # The raised case: the part drops its publisher and retries later.
        with contextlib.suppress(RelayError):
            pub._call(pub._producer.init_transactions, 1.0)
        pub.close()
        gone = weakref.ref(pub)
        del pub
        assert gone() is None  # freed by reference counting alone


class CommitAwaitingTheRead(ThreadRecordingProducer):
    """A commit that returns only once the next batch was read beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.read = threading.Event()

    def commit_transaction(self, timeout: float) -> None:
        assert self.read.wait(5), "the next batch was not read while this committed"
        super().commit_transaction(timeout)


def test_a_backlog_s_commit_travels_on_the_call_thread_while_the_next_batch_is_read() -> None:
    """The commit's calls run on the producer's call thread while the caller reads the
    next batch: no helper thread waits on it. A pool of those, as many as the relay's
    producers, waited the whole time on call threads: 8 threads of 1,000 subscribers'
    relay for nothing (#53)."""
    producer = CommitAwaitingTheRead()
    pub = publisher(producer)
    during: list[threading.Thread] = []
    before = set(threading.enumerate())

    def read_next() -> None:
        during.append(threading.current_thread())
        producer.read.set()

    batch = Batch(records(b"a"), Position(1, 1), "gen", may_extend=False)
    pub.publish(batch, meanwhile=read_next)
    assert producer.committed == [[b"a"]]
    assert during == [threading.current_thread()]
    (call_thread,) = set(producer.threads["bounded"])
    assert set(threading.enumerate()) - before == {call_thread}
    pub.close()


class ExistingTopics:
    """An admin client whose every topic to create exists already."""

    def create_topics(self, topics: list[Any], **timeouts: float) -> dict[str, Future[None]]:
        futures: dict[str, Future[None]] = {}
        for topic in topics:
            future = futures[topic.topic] = Future()
            error = KafkaError(KafkaError.TOPIC_ALREADY_EXISTS, f"{topic.topic} exists")
            future.set_exception(KafkaException(error))
        return futures


def test_a_topic_that_exists_leaves_no_cycle_holding_its_caller() -> None:
    # The "exists already" future's exception, raised, held the creator's frame and
    # every caller's with it: each of 1,000 parts' publishers and their clients' threads
    # lived until the cyclic collector, rare in a relay (tune_gc; issue #53).
    creator = TopicCreator({})
    creator._admin = ExistingTopics  # type: ignore[method-assign,assignment]

    def publishing(part: object) -> None:
        creator.ensure({"orders"})

    with without_cyclic_collector():
        part = Sentinel()
        gone = weakref.ref(part)
        publishing(part)
        assert creator.known() == {"orders"}
        del part
        assert gone() is None  # freed by reference counting alone


class Sentinel:
    """What a caller's frame holds (a part's publisher)."""


class FailingCreation:
    """An admin client whose every topic's creation fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def create_topics(self, topics: list[Any], **timeouts: float) -> dict[str, Future[None]]:
        futures: dict[str, Future[None]] = {}
        for topic in topics:
            futures[topic.topic] = Future()
            futures[topic.topic].set_exception(self.error)
        return futures


UNREACHABLE = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))


@pytest.mark.parametrize(
    "error", [UNREACHABLE, RuntimeError("not the client's")], ids=["kafka", "other"]
)
def test_a_failed_creation_leaves_no_cycle_holding_its_caller(error: Exception) -> None:
    # Raised, the failure took the creator's frame into its traceback while the frame
    # held it (the other kind raised as it was: its future's own exception), and every
    # caller's frame with it: the part's publisher and its clients' threads lived until
    # the cyclic collector, rare in a relay (tune_gc; issue #53).
    creator = TopicCreator({})
    creator._admin = lambda: FailingCreation(error)  # type: ignore[method-assign,assignment,return-value]

    def publishing(part: object) -> None:
        creator.ensure({"orders"})

    with without_cyclic_collector():
        part = Sentinel()
        gone = weakref.ref(part)
        with contextlib.suppress(BrokerUnavailable):
            publishing(part)
        del part
        assert gone() is None  # freed by reference counting alone


def test_a_creation_failure_not_the_client_s_is_retried_as_kafka_s() -> None:
    """Only the client's errors have a code to classify; any other is retried, as
    classify retries a creation failure without one, and it is the cause."""
    cause = RuntimeError("not the client's")
    creator = TopicCreator({})
    creator._admin = lambda: FailingCreation(cause)  # type: ignore[method-assign,assignment,return-value]
    with pytest.raises(BrokerUnavailable, match="cannot create topic 'orders'") as raised:
        creator.ensure({"orders"})
    assert raised.value.__cause__ is cause


class CommitTimingOutOnce(FakeProducer):
    """commit_transaction times out once (retriable: librdkafka resumes it when asked
    again), then commits."""

    def __init__(self) -> None:
        super().__init__(reject=b"never")
        self.offsets_sent = 0
        self.timeouts = 1

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.offsets_sent += 1

    def commit_transaction(self, timeout: float) -> None:
        if self.timeouts:
            self.timeouts -= 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True))
        super().commit_transaction(timeout)


@pytest.mark.parametrize("overlapping", [True, False], ids=["overlapping", "alone"])
def test_a_commit_step_that_failed_is_made_again_from_that_step(overlapping: bool) -> None:
    """Started ahead on the call thread, a commit whose second call failed goes on as a
    call made on this thread would: that call asked again, the offsets not sent twice."""
    producer = CommitTimingOutOnce()
    batch = Batch(records(b"a"), Position(1, 1), "gen", may_extend=not overlapping)
    publisher(producer).publish(batch, meanwhile=lambda: None)
    assert producer.committed == [[b"a"]]
    assert producer.offsets_sent == 1 and producer.timeouts == 0


class UnreachableCoordinator(FakeProducer):
    def send_offsets_to_transaction(self, *args: Any) -> None:
        raise BrokerUnavailable("the coordinator is away")


def test_a_failed_overlapping_commit_leaves_no_cycle_holding_the_publisher() -> None:
    # Raised from its future, the commit's failure held the frame that held the future.
    with without_cyclic_collector():
        pub = publisher(UnreachableCoordinator(reject=b"none"))
        with contextlib.suppress(BrokerUnavailable):
            pub._commit_overlapping([], None, lambda: None)
        pub.close()
        gone = weakref.ref(pub)
        del pub
        assert gone() is None  # freed by reference counting alone


class InitRecordingProducer(ThreadRecordingProducer):
    """Records the thread of its fence and when it ran (each takes 0.2 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.fenced: list[tuple[threading.Thread, float, float]] = []

    def init_transactions(self, timeout: float) -> None:
        began = time.monotonic()
        time.sleep(0.2)
        self.fenced.append((threading.current_thread(), began, time.monotonic()))


def part_on(producers: list[InitRecordingProducer]) -> Any:
    """A part's publisher as the relay's factory opens it, on these stand-in clients
    (its checkpoint topic there already, its checkpoint read as none)."""
    settings = Settings(bootstrap_servers="127.0.0.1:1")
    factory = PublisherFactory(settings, TopicGuard(settings.checkpoint_topic), None)
    part = factory(SimpleNamespace(name="s", part=0, subscriber_id=1))  # type: ignore[arg-type]
    first, second = part._first, part._second  # type: ignore[attr-defined]
    for publisher_, producer in zip((first, second), producers, strict=True):
        publisher_._producer = producer
        publisher_._topics = topic_t_exists()
        publisher_._checkpoint_topic = "t"
    first.checkpoint = lambda generation: None  # no broker to read it from
    return part


def test_a_part_s_two_producers_share_one_call_thread_and_fence_side_by_side() -> None:
    """Their calls never overlap but at recovery: one thread serves both, and the
    second's fence runs beside the first's on a thread for it alone, which ends. A
    thread each was 8 threads of 1,000 subscribers' relay (#53)."""
    producers = [InitRecordingProducer(), InitRecordingProducer()]
    part = part_on(producers)
    part.recover("gen")
    (on_first, began_first, ended_first), (on_second, began_second, ended_second) = (
        producers[0].fenced[0],
        producers[1].fenced[0],
    )
    assert on_first.name == "kafka-txn-call" and on_second.name == "kafka-txn-fence"
    assert began_first < ended_second and began_second < ended_first  # side by side
    on_second.join(5.0)  # a wait for its end, not a measure of it
    assert not on_second.is_alive()
    part.publish(Batch(records(b"a"), Position(1, 1), "gen"))
    part.publish(Batch(records(b"b"), Position(1, 2), "gen"))
    assert [p.committed for p in producers] == [[[b"a"]], [[b"b"]]]
    assert set(producers[0].threads["bounded"] + producers[1].threads["bounded"]) == {on_first}
    part.close()


class CoordinatorLoadingOnce(InitRecordingProducer):
    """A fresh broker: the first init_transactions is answered "coordinator load in
    progress" (retriable), the next one fences."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 1

    def init_transactions(self, timeout: float) -> None:
        if self.refusals:
            self.refusals -= 1
            error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, "loading", retriable=True)
            raise KafkaException(error)
        super().init_transactions(timeout)


def test_a_fence_the_broker_is_not_ready_for_is_asked_again_on_either_thread() -> None:
    producers = [CoordinatorLoadingOnce(), CoordinatorLoadingOnce()]
    part = part_on(producers)
    part.recover("gen")
    assert [len(p.fenced) for p in producers] == [1, 1]
    part.publish(Batch(records(b"a"), Position(1, 1), "gen"))
    assert producers[0].committed == [[b"a"]]
    part.close()
