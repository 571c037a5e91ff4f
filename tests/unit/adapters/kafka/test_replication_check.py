"""The start-up advice about topics one broker lost would stop (relay/adapters/kafka/replication_check.py),
against a stand-in admin client."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from relay.adapters.kafka.replication_check import check_replication, relay_topics


class FakeAdmin:
    """``brokers`` brokers; ``topics`` maps a topic to (replicas, min.insync.replicas)."""

    def __init__(
        self, brokers: int, topics: dict[str, tuple[int, int]], defaults: tuple[int, int]
    ) -> None:
        self._brokers = brokers
        self._topics = topics
        self._defaults = defaults

    def list_topics(self, timeout: float) -> Any:
        partitions = {
            name: SimpleNamespace(partitions={0: SimpleNamespace(replicas=list(range(rf)))})
            for name, (rf, _) in self._topics.items()
        }
        return SimpleNamespace(
            brokers=dict.fromkeys(range(1, self._brokers + 1)), topics=partitions
        )

    def describe_configs(self, resources: list[Any], request_timeout: float) -> dict[Any, Any]:
        answers = {}
        for resource in resources:
            if resource.name in self._topics:
                values = {"min.insync.replicas": str(self._topics[resource.name][1])}
            else:  # a broker
                rf, isr = self._defaults
                values = {"default.replication.factor": str(rf), "min.insync.replicas": str(isr)}
            future: Future[dict[str, Any]] = Future()
            future.set_result({k: SimpleNamespace(value=v) for k, v in values.items()})
            answers[resource] = future
        return answers


RELEVANT = relay_topics(["outbox.event.{aggregate_type}"], "outbox-relay.checkpoints")


def test_the_relays_topics_are_the_checkpoint_topic_and_what_templates_yield() -> None:
    assert RELEVANT("outbox.event.order") and RELEVANT("outbox-relay.checkpoints")
    assert not RELEVANT("other.order") and not RELEVANT("outbox.event.")


def test_one_replica_or_min_isr_1_on_several_brokers_is_advised_against() -> None:
    admin = FakeAdmin(
        3,
        {"outbox.event.order": (1, 1), "outbox-relay.checkpoints": (3, 2), "other": (1, 1)},
        defaults=(3, 2),
    )
    warnings = check_replication(admin, RELEVANT, creates_with=-1)  # type: ignore[arg-type]
    assert len(warnings) == 2
    assert "['outbox.event.order'] have one replica" in warnings[0]
    assert "['outbox.event.order'] have min.insync.replicas=1" in warnings[1]


def test_new_topics_with_one_replica_are_advised_against() -> None:
    admin = FakeAdmin(3, {}, defaults=(1, 1))
    warnings = check_replication(admin, RELEVANT, creates_with=-1)  # type: ignore[arg-type]
    assert any("default.replication.factor is 1" in w for w in warnings)
    assert any("min.insync.replicas is 1" in w for w in warnings)
    warnings = check_replication(FakeAdmin(3, {}, (3, 2)), RELEVANT, creates_with=1)  # type: ignore[arg-type]
    assert warnings == [
        "topic_replication_factor is 1: topics the relay creates get one replica. Recommended: 3"
    ]


def test_a_single_broker_gets_no_advice() -> None:
    admin = FakeAdmin(1, {"outbox.event.order": (1, 1)}, defaults=(1, 1))
    assert check_replication(admin, RELEVANT, creates_with=1) == []  # type: ignore[arg-type]
