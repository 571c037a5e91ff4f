"""The demo's second run counts from where the first left each partition: the ends are
asked again until every partition answers (a restarted broker's leaders come back late),
instead of counting the earlier run's records as this run's."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaException, TopicPartition

from relay.localstack import demo


class Topic:
    def __init__(self, partitions: int) -> None:
        self.partitions = {p: None for p in range(partitions)}


class RestartedBroker:
    """Lists one topic short of partitions, then times out a watermark, then answers."""

    answers = 0

    def __init__(self, config: dict[str, Any]) -> None:
        pass

    def list_topics(self, timeout: float) -> Any:
        RestartedBroker.answers += 1
        listed = 1 if RestartedBroker.answers == 1 else 3
        return type("Meta", (), {"topics": {t: Topic(listed) for t in demo.DEMO_TOPICS}})

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        if RestartedBroker.answers == 2:
            raise KafkaException("leader not available")
        return 0, 100 + tp.partition

    def close(self) -> None:
        pass


def test_the_ends_are_asked_again_until_every_partition_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo, "Consumer", RestartedBroker)
    monkeypatch.setattr(demo.time, "sleep", lambda _: None)
    ends = demo._end_offsets("broker:9092", partitions=3)
    assert RestartedBroker.answers == 3
    assert ends == {(t, p): 100 + p for t in demo.DEMO_TOPICS for p in range(3)}
