"""The fan-out bench's subscriber count and its first-event-to-last clock
(bench/fanout.py). No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import pytest

from bench.fanout import SUBSCRIBERS, floor_figures, span_seconds, subscriber_count
from bench.fanout_floor import records_for
from bench.method import Samples


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


def test_the_relays_ratio_is_set_against_the_plain_clients_round_by_round() -> None:
    rates = {"plain many": Samples((30.0, 60.0, 40.0)), "plain 1": Samples((100.0, 100.0, 80.0))}
    spans = {"many": Samples((40.0, 30.0, 50.0)), "1": Samples((100.0, 100.0, 100.0))}
    plain, relay = floor_figures(1000, rates, spans.__getitem__, {})
    assert (plain.value, plain.baseline) == (40.0, 100.0)
    # The relay's rounds: 0.4, 0.3, 0.5 of one subscriber's; the clients': 0.3, 0.6, 0.5.
    assert (relay.value, relay.baseline) == (0.4, 0.5)
    assert relay.ratio_range == pytest.approx((0.5, 4 / 3))


def test_a_plain_client_publishes_the_records_the_relays_encoder_makes() -> None:
    records = records_for("floor.s7", "order7", 12)
    assert [r.topic for r in records] == ["floor.s7"] * 12
    assert [r.key for r in records][:2] == [b"k0", b"k1"]
    assert {dict(r.headers)["aggregate_type"] for r in records} == {b"order7"}
