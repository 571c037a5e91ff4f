"""Sampled warnings (relay/core/log_sampling.py, issue #47): a flood of poison
rows logs the first few of each interval, then one line that counts the rest."""

from __future__ import annotations

import logging

import pytest

from relay.core.log_sampling import SampledLog

LOG = logging.getLogger("tests.sampled")


def sampled(now: list[float]) -> SampledLog:
    return SampledLog(LOG, "%d left out in %.0f s", lambda n: {"count": n}, first=3,
                      interval=60.0, clock=lambda: now[0])  # fmt: skip


def summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_the_first_few_of_an_interval_pass_the_rest_are_summed_up_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = sampled(now)
    assert [log.allows() for _ in range(10)] == [True] * 3 + [False] * 7
    log.tick()  # the interval is not over
    assert summaries(caplog) == []
    now[0] = 61.0
    log.tick()
    assert summaries(caplog) == ["7 left out in 61 s"]
    assert caplog.records[-1].__dict__["count"] == 7
    assert log.allows()  # a new interval: one by one again
    log.flush()
    assert summaries(caplog) == ["7 left out in 61 s"]  # nothing left out since


def test_the_next_warning_after_the_interval_says_what_was_left_out_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = sampled(now)
    for _ in range(5):
        log.allows()
    now[0] = 90.0
    assert log.allows()
    assert summaries(caplog) == ["2 left out in 90 s"]
    for _ in range(4):
        log.allows()
    log.flush()  # the part caught up
    assert summaries(caplog)[-1] == "2 left out in 0 s"
