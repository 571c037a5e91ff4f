"""The transactional publisher's fast path and its diagnosis, against a stand-in client.

Records are produced without a delivery report each; a failed record makes the commit
fail, and the batch is run again with reports to name the record at fault. A stand-in
client makes each case exact; ``test_exactly_once.py`` has the same path against
Apache Kafka refusing a record over a topic's ``max.message.bytes``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

import relay.kafka
from relay.errors import PoisonRecordError, ProducerFenced
from relay.kafka import TopicCreator, TransactionalPublisher
from relay.model import KafkaRecord, Position
from relay.ports import Batch


class FakeMessage:
    def __init__(self, headers: list[tuple[str, bytes]]) -> None:
        self._headers = headers

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers


class FakeProducer:
    """Fails a record whose value is in ``reject`` (``times`` times, then accepts it)."""

    def __init__(self, reject: bytes, times: int = 1_000) -> None:
        self.reject, self.times = reject, times
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
                callback(error, FakeMessage(record.headers))  # type: ignore[arg-type]
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


def publisher(producer: FakeProducer, delivery_timeout_s: float = 5.0) -> TransactionalPublisher:
    pub = TransactionalPublisher(
        {"bootstrap.servers": "127.0.0.1:1"},
        TopicCreator({}, enabled=False),
        delivery_timeout_s,
        transactional_id="t",
        group_prefix="g",
        checkpoint_topic="c",
        consumer_config={"bootstrap.servers": "127.0.0.1:1"},
    )
    pub._producer = producer  # type: ignore[assignment]
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
    monkeypatch.setattr(relay.kafka, "_CALL_GRACE_S", 0.2)
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
    assert all(t + relay.kafka._CALL_GRACE_S <= 15.0 for t in producer.timeouts), producer.timeouts
