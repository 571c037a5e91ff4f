"""The Kafka source's driver-side decisions as unit tests, with the broker's answers
stubbed. The same behaviours run against Apache Kafka (DeleteRecords, CreatePartitions)
in ``test_spark_kafka_source.py``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable

from spark_jobs.kafka_offsets import Watermarks
from spark_jobs.kafka_source import KafkaRange, KafkaSourceError, KafkaStreamReader, kafka_schema


class StubbedReader(KafkaStreamReader):
    def __init__(self, logs: Watermarks, **options: str) -> None:
        super().__init__(
            kafka_schema(), {"subscribe": "t", "kafka.bootstrap.servers": "unused:1", **options}
        )
        self.logs = logs

    def _watermarks(self) -> Watermarks:
        return self.logs


def ranges(reader: KafkaStreamReader, start: Any, end: Any) -> list[tuple[str, int, int, int]]:
    found = reader.partitions(start, end)
    return [(r.topic, r.partition, r.start, r.end) for r in found if isinstance(r, KafkaRange)]


def test_deleted_offsets_fail_the_query_with_a_clear_message() -> None:
    reader = StubbedReader({"t": {"0": (5, 20)}})  # offsets 0-4 were deleted (retention)
    with pytest.raises(KafkaSourceError, match=r"t-0: offsets 0\.\.4 were deleted.*failOnDataLoss"):
        reader.partitions({"t": {"0": 0}}, {"t": {"0": 20}})


def test_with_fail_on_data_loss_false_the_query_skips_to_what_is_left() -> None:
    reader = StubbedReader({"t": {"0": (5, 20)}}, failOnDataLoss="false")
    assert ranges(reader, {"t": {"0": 0}}, {"t": {"0": 20}}) == [("t", 0, 5, 20)]


def test_partitions_added_while_running_are_read_from_their_start() -> None:
    reader = StubbedReader({"t": {"0": (0, 10), "1": (0, 4)}})
    end = reader.latestOffset({"t": {"0": 10}}, ReadAllAvailable())
    assert end == {"t": {"0": 10, "1": 4}}
    assert ranges(reader, {"t": {"0": 10}}, end) == [("t", 1, 0, 4)]


def test_options_are_validated_with_their_names() -> None:
    with pytest.raises(KafkaSourceError, match="exactly one of the options subscribe"):
        KafkaStreamReader(kafka_schema(), {"kafka.bootstrap.servers": "x"})
    with pytest.raises(KafkaSourceError, match="failOnDataLoss must be true or false"):
        StubbedReader({}, failOnDataLoss="maybe")
    with pytest.raises(KafkaSourceError, match="assign must be JSON"):
        KafkaStreamReader(kafka_schema(), {"assign": "t:0", "kafka.bootstrap.servers": "x"})


def test_a_new_partition_whose_start_was_deleted_starts_at_its_log_start() -> None:
    reader = StubbedReader({"t": {"0": (0, 10), "1": (3, 8)}})
    assert ranges(reader, {"t": {"0": 10}}, {"t": {"0": 10, "1": 8}}) == [("t", 1, 3, 8)]
