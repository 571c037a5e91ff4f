"""How the broker watch judges Kafka reachable (relay/adapters/kafka/broker_watch.py), against a
stand-in admin client: any broker answering metadata is enough, and one request lost
to a broker that just died is not an outage. A partition the relay writes without a
live leader is named, and stalls only its parts: the relay stays reachable. Kafka's
silence is counted from its last answer, on a clock of the test's own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError, KafkaException

import relay.adapters.kafka.broker_watch
from relay.adapters.kafka.broker_watch import BrokerWatch


class FakeClock:
    """Seconds that pass only when the test (or a request it times out) says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeAdmin:
    """Answers ``list_topics`` with the outcomes queued: an exception, a broker count, or
    metadata (:func:`metadata`). A request that fails takes its whole ``timeout`` on
    :attr:`clock`, as a request into a black hole does."""

    outcomes: ClassVar[list[Any]] = []
    clock: ClassVar[FakeClock] = FakeClock()

    def __init__(self, config: dict[str, Any]) -> None:
        self.asked = 0

    def list_topics(self, timeout: float) -> Any:
        outcome = FakeAdmin.outcomes.pop(0)
        if isinstance(outcome, Exception):
            FakeAdmin.clock.now += timeout
            raise outcome
        if isinstance(outcome, SimpleNamespace):
            return outcome
        return SimpleNamespace(brokers=dict.fromkeys(range(outcome)), topics={})

    def describe_cluster(self, **kwargs: Any) -> Any:
        raise AssertionError("DescribeCluster waits for the controller: one node, not any")


def metadata(brokers: list[int], **leaders: list[int]) -> SimpleNamespace:
    """A cluster's metadata: live ``brokers``, and topics (``_`` for ``.``) whose
    partitions have the leaders given (-1: none)."""

    def partition(i: int, leader: int) -> SimpleNamespace:
        error = KafkaError(KafkaError.LEADER_NOT_AVAILABLE) if leader < 0 else None
        return SimpleNamespace(id=i, leader=leader, error=error)

    topics = {
        name.replace("_", "."): SimpleNamespace(
            error=None, partitions={i: partition(i, leader) for i, leader in enumerate(ids)}
        )
        for name, ids in leaders.items()
    }
    return SimpleNamespace(brokers=dict.fromkeys(brokers), topics=topics)


WRITTEN = frozenset({"orders", "relay.checkpoints"})


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> BrokerWatch:
    """A watch of a relay that has written to ``orders`` and its checkpoint topic."""
    monkeypatch.setattr(relay.adapters.kafka.broker_watch, "AdminClient", FakeAdmin)
    return BrokerWatch(
        {"bootstrap.servers": "a:1,b:2,c:3"},
        interval=1.0,
        timeout=0.1,
        written_topics=lambda: WRITTEN,
    )


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> BrokerWatch:
    monkeypatch.setattr(relay.adapters.kafka.broker_watch, "AdminClient", FakeAdmin)
    return BrokerWatch({"bootstrap.servers": "a:1,b:2,c:3"}, interval=1.0, timeout=0.1)


def timed_out() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._TIMED_OUT))


def test_metadata_from_any_broker_is_kafka_answering(watch: BrokerWatch) -> None:
    FakeAdmin.outcomes = [2]  # one of three nodes down: the others answer
    watch._ask()
    assert watch.reachable is True


def test_one_request_lost_to_a_dying_broker_is_asked_again(watch: BrokerWatch) -> None:
    FakeAdmin.outcomes = [3, timed_out(), 2]
    watch._ask()
    watch._ask()
    assert watch.reachable is True and watch.silent_for() < 1.0  # just answered


def test_a_cluster_that_does_not_answer_is_unreachable(watch: BrokerWatch) -> None:
    FakeAdmin.outcomes = [3, timed_out(), timed_out(), 0]
    watch._ask()
    watch._ask()
    assert watch.reachable is False and "asking for metadata" in watch.describe()
    watch._ask()  # an answer that names no broker is no better
    assert watch.reachable is False


def test_a_partition_written_without_a_leader_stalls_its_parts_not_the_relay(
    writer: BrokerWatch, caplog: pytest.LogCaptureFixture
) -> None:
    FakeAdmin.outcomes = [metadata([1, 3], orders=[1, -1, 3], relay_checkpoints=[3, 1])]
    writer._ask()
    assert writer.reachable is True and writer.silent_for() < 1.0  # just answered
    assert writer.leaderless == ("orders[1]",)
    assert "no leader since" in writer.describe() and "orders[1]" in writer.describe()
    [warning] = [r for r in caplog.records if r.name == "relay.adapters.kafka.broker_watch"]
    assert warning.levelname == "WARNING" and "keeps its parts" in warning.getMessage()


def test_a_leader_that_is_no_live_broker_is_no_leader(writer: BrokerWatch) -> None:
    # Node 2 died: metadata may still name it until the controller moves its partitions.
    FakeAdmin.outcomes = [metadata([1, 3], orders=[1, 2, 3], relay_checkpoints=[2, 1])]
    writer._ask()
    assert writer.reachable is True
    assert writer.leaderless == ("orders[1]", "relay.checkpoints[0]")


def test_topics_the_relay_does_not_write_are_not_its_concern(writer: BrokerWatch) -> None:
    FakeAdmin.outcomes = [metadata([1, 2, 3], orders=[1, 2, 3], others=[-1, -1])]
    writer._ask()
    assert writer.reachable is True and writer.leaderless == ()
    assert writer.describe() == "Kafka at a:1,b:2,c:3 answers"


def test_leaders_elected_again_clear_the_stall(
    writer: BrokerWatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", "relay.adapters.kafka.broker_watch")
    FakeAdmin.outcomes = [
        metadata([1, 3], orders=[-1, -1, -1]),
        metadata([1, 3], orders=[1, 3, 1]),
    ]
    writer._ask()
    assert len(writer.leaderless) == 3
    writer._ask()
    assert writer.leaderless == () and writer.reachable is True
    assert "has a leader again" in caplog.records[-1].getMessage()


@pytest.fixture
def clocked(monkeypatch: pytest.MonkeyPatch) -> tuple[BrokerWatch, FakeClock]:
    """A watch asking every 2 s, each request given 5 s, on a fake clock."""
    monkeypatch.setattr(relay.adapters.kafka.broker_watch, "AdminClient", FakeAdmin)
    clock = FakeAdmin.clock = FakeClock()
    watch = BrokerWatch({"bootstrap.servers": "a:1"}, interval=2.0, timeout=5.0, clock=clock)
    return watch, clock


def test_silence_is_counted_from_the_last_answer(clocked: tuple[BrokerWatch, FakeClock]) -> None:
    # Issue #49: counted from the second failed request's end, a relay cut from Kafka
    # held its parts for two requests' timeouts more than session_timeout (27-29 s).
    watch, clock = clocked
    FakeAdmin.outcomes = [3, timed_out(), timed_out()]
    watch._ask()
    answered = clock.now
    clock.now += 2.0  # the interval; then the cut: both requests time out (5 s each)
    watch._ask()
    assert watch.reachable is False
    assert watch.silent_for() == clock.now - answered == 12.0
    clock.now += 3.0
    assert watch.silent_for() == 15.0


def test_silence_counts_before_the_verdict(clocked: tuple[BrokerWatch, FakeClock]) -> None:
    # Behind a black hole the request hangs: no verdict for two timeouts (10 s), yet the
    # silence that the session timeout is measured against has been growing all along.
    watch, clock = clocked
    FakeAdmin.outcomes = [3]
    watch._ask()
    clock.now += 10.0  # the next request sent, unanswered, still waiting
    assert watch.reachable is True and watch.silent_for() == 10.0
    assert "has not answered since" in watch.describe_silence()


def test_an_answer_again_resets_the_count(clocked: tuple[BrokerWatch, FakeClock]) -> None:
    watch, clock = clocked
    FakeAdmin.outcomes = [3, timed_out(), timed_out(), 3, timed_out(), timed_out()]
    watch._ask()
    clock.now += 2.0
    watch._ask()
    clock.now += 2.0
    watch._ask()  # Kafka answers again
    assert watch.reachable is True and watch.silent_for() == 0.0
    answered = clock.now
    clock.now += 2.0
    watch._ask()
    assert watch.silent_for() == clock.now - answered == 12.0


def test_a_relay_that_never_reached_kafka_counts_from_its_start(
    clocked: tuple[BrokerWatch, FakeClock],
) -> None:
    watch, _ = clocked
    FakeAdmin.outcomes = [timed_out()]
    watch._ask()  # nothing answered yet: no second request
    assert watch.reachable is False and watch.silent_for() == 5.0
