"""The fan-out bench's subscriber count and its first-event-to-last clock
(bench/fanout.py). No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import pytest

from bench.fanout import SUBSCRIBERS, span_seconds, subscriber_count


def test_the_subscriber_count_is_100_unless_set() -> None:
    assert subscriber_count({}) == 100
    assert subscriber_count({SUBSCRIBERS: ""}) == 100
    assert subscriber_count({SUBSCRIBERS: "1000"}) == 1000


def test_a_fanout_of_one_subscriber_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        subscriber_count({SUBSCRIBERS: "1"})


def test_a_subscriber_count_that_is_no_number_names_the_variable() -> None:
    with pytest.raises(ValueError, match=f"{SUBSCRIBERS}='1k': not a whole number"):
        subscriber_count({SUBSCRIBERS: "1k"})


def test_the_span_runs_from_the_first_record_of_any_partition_to_the_last_of_all() -> None:
    assert span_seconds([2_000, 1_500, 3_000], [9_000, 11_500, 4_000]) == 10.0


def test_an_empty_partitions_timestamp_is_left_out() -> None:
    assert span_seconds([-1, 1_000], [-1, 3_000]) == 2.0
