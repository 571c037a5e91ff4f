"""The Kafka source's offset arithmetic (no Spark, no broker)."""

from __future__ import annotations

import pytest

from spark_jobs import kafka_offsets
from spark_jobs.kafka_offsets import OffsetSpecError

LOGS = {"t": {"0": (5, 100), "1": (0, 40)}}


def test_starting_offsets_like_spark() -> None:
    assert kafka_offsets.starting_offsets("earliest", LOGS) == {"t": {"0": 5, "1": 0}}
    assert kafka_offsets.starting_offsets("latest", LOGS) == {"t": {"0": 100, "1": 40}}
    # -2 earliest, -1 latest, a partition left out starts at latest.
    assert kafka_offsets.starting_offsets('{"t": {"0": -2}}', LOGS) == {"t": {"0": 5, "1": 40}}
    assert kafka_offsets.starting_offsets('{"t": {"1": 7}}', LOGS) == {"t": {"0": 100, "1": 7}}
    with pytest.raises(OffsetSpecError, match="startingOffsets"):
        kafka_offsets.starting_offsets("newest", LOGS)


def test_new_partitions_start_at_zero_and_offsets_never_go_back() -> None:
    end = kafka_offsets.advance({"t": {"0": 50}}, {"t": {"0": 40, "1": 9}})
    assert end == {"t": {"0": 50, "1": 9}}


def test_rate_limit_shares_by_backlog_and_always_progresses() -> None:
    start = {"t": {"0": 0, "1": 0}}
    end = {"t": {"0": 300, "1": 100}}
    capped = kafka_offsets.rate_limit(start, end, 100)
    assert capped == {"t": {"0": 75, "1": 25}}
    assert sum(capped["t"].values()) == 100
    tiny = kafka_offsets.rate_limit(start, end, 1)
    assert sum(tiny["t"].values()) == 1
    assert kafka_offsets.rate_limit(start, end, 1000) == end


def test_ranges_skip_partitions_without_new_offsets() -> None:
    ranges = kafka_offsets.ranges({"t": {"0": 10, "1": 4}}, {"t": {"0": 10, "1": 9, "2": 3}})
    assert ranges == [("t", 1, 4, 9), ("t", 2, 0, 3)]
