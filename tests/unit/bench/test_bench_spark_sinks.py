"""The cluster sinks' bench (bench/spark_sinks.py) reads its rate from the driver's
per-batch lines as the archive logs them: every batch but the first, and all of the
backlog accounted for. No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import logging

import pytest

from bench.spark_sinks import SinkRunError, measured_rate
from spark_jobs.run_summary import ArchiveSummary


class Progress:
    """What the summary reads of a batch's ``StreamingQueryProgress``."""

    def __init__(self, batch_id: int, rows: int, ms: int) -> None:
        self.batchId, self.numInputRows, self.batchDuration = batch_id, rows, ms
        self.observedMetrics: dict[str, object] = {}


def driver_log(caplog: pytest.LogCaptureFixture, batches: list[tuple[int, int]]) -> str:
    """The archive's own lines for ``batches`` of (rows, milliseconds), as its driver logs them."""
    with caplog.at_level(logging.INFO, logger="spark_jobs.run_summary"):
        ArchiveSummary("archive").progressed(
            [Progress(i, rows, ms) for i, (rows, ms) in enumerate(batches)]
        )
    return "\n".join(f"INFO {r.name}: {r.getMessage()}" for r in caplog.records)


def test_the_first_batch_warms_up_and_the_others_are_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = driver_log(caplog, [(1000, 9000), (1000, 2000), (500, 1000)])
    assert measured_rate(log, 2500) == pytest.approx(1500 / 3.0)


def test_batches_that_miss_records_are_no_figure(caplog: pytest.LogCaptureFixture) -> None:
    log = driver_log(caplog, [(1000, 9000), (1000, 2000)])
    with pytest.raises(SinkRunError, match="2500 records"):
        measured_rate(log, 2500)


def test_one_batch_leaves_nothing_to_measure(caplog: pytest.LogCaptureFixture) -> None:
    log = driver_log(caplog, [(2500, 9000)])
    with pytest.raises(SinkRunError):
        measured_rate(log, 2500)
