"""The Spark jobs' exactly-once Kafka sink produces as the relay does: one request in
flight, so a batch refused "not leader" is retried first, never counted delivered
because a later one succeeded (docs/design.md §5)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from spark_jobs import kafka_sink


class RecordingProducer:
    configs: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        RecordingProducer.configs.append(config)

    def init_transactions(self, timeout: float) -> None:
        pass


def test_the_sinks_producer_keeps_one_request_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_sink, "Producer", RecordingProducer)
    sink = kafka_sink.KafkaBatchSink("b:1", "out", "avg", {"security.protocol": "plaintext"})
    sink._ready_producer()
    [config] = RecordingProducer.configs
    assert config["max.in.flight.requests.per.connection"] == 1
    assert config["enable.idempotence"] is True
    assert config["transactional.id"] == "spark-sink.avg"
