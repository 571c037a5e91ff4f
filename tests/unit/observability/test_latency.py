"""The commit→visible histogram's buckets and sum, in whole microseconds (no servers)."""

from __future__ import annotations

from relay.observability.latency import CommitLatency


def test_an_age_on_a_bound_is_in_that_bucket_and_a_microsecond_more_is_not() -> None:
    latency = CommitLatency()
    latency.observe([0, 5_000, 5_001, 300_000_000, 300_000_001])
    counts = latency.counts()
    assert counts["commit_to_visible_le_0.005"] == 2
    assert counts["commit_to_visible_le_0.01"] == 1
    assert counts["commit_to_visible_le_300.0"] == 1
    assert counts["commit_to_visible_le_+Inf"] == 1
    assert counts["commit_to_visible_count"] == 5
    assert counts["commit_to_visible_sum_us"] == 600_010_002
