"""How the broker watch judges Kafka reachable (relay/broker_watch.py), against a
stand-in admin client: any broker answering metadata is enough, and one request lost
to a broker that just died is not an outage."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError, KafkaException

import relay.broker_watch
from relay.broker_watch import BrokerWatch


class FakeAdmin:
    """Answers ``list_topics`` with the outcomes queued (an exception or a broker count)."""

    outcomes: ClassVar[list[Any]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.asked = 0

    def list_topics(self, timeout: float) -> Any:
        outcome = FakeAdmin.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return SimpleNamespace(brokers=dict.fromkeys(range(outcome)), topics={})

    def describe_cluster(self, **kwargs: Any) -> Any:
        raise AssertionError("DescribeCluster waits for the controller: one node, not any")


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> BrokerWatch:
    monkeypatch.setattr(relay.broker_watch, "AdminClient", FakeAdmin)
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
    assert watch.reachable is True and watch.unreachable_for() == 0.0


def test_a_cluster_that_does_not_answer_is_unreachable(watch: BrokerWatch) -> None:
    FakeAdmin.outcomes = [3, timed_out(), timed_out(), 0]
    watch._ask()
    watch._ask()
    assert watch.reachable is False and "asking for metadata" in watch.describe()
    watch._ask()  # an answer that names no broker is no better
    assert watch.reachable is False
