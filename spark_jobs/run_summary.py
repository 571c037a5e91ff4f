"""What a job's run did, in one line at its end: batches, rows in, rows out, quarantined.

A streaming query's progress gives the batches and the rows read (read by the driver
while it waits for the query, from the query's own recent progress: a listener hears
of it asynchronously, maybe after the run has ended); only the job's own sink knows
what it wrote and what it quarantined (a replayed batch writes nothing), so the batch
writers add those as each batch commits. The archive, whose sink is Spark's file sink,
counts from the progress alone: every row read is written, and an undecodable one is
archived with its error (its quarantine).

Each batch is also logged as it is counted, one INFO line with its id, rows in and out,
and duration: a job's progress where its driver's log goes (a cluster's too)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)


class RunSummary:
    """Counts one run of a job; :meth:`line` says it."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.batches = 0
        self.rows_in = 0
        self.rows_out = 0
        self.quarantined = 0
        self.replayed = 0  # batches a sink had already written: nothing written again
        self._last_batch = -1
        self._written: dict[int, tuple[int, int]] = {}  # per batch id, until logged

    def wrote(self, rows_out: int, quarantined: int, batch_id: int | None = None) -> None:
        """A batch (``batch_id``) committed ``rows_out`` rows and quarantined ``quarantined``."""
        self.rows_out += rows_out
        self.quarantined += quarantined
        if batch_id is not None:
            out, bad = self._written.get(batch_id, (0, 0))
            self._written[batch_id] = (out + rows_out, bad + quarantined)

    def skipped_replay(self) -> None:
        self.replayed += 1

    def progressed(self, recent: Iterable[Any]) -> None:
        """The query's recent progress (``query.recentProgress``): each batch not yet
        counted. Batch ids only grow within a query, a restart's included."""
        for progress in recent:
            if progress.batchId <= self._last_batch:
                continue
            self._last_batch = progress.batchId
            self.batches += 1
            self.rows_in += int(progress.numInputRows)
            self.batch_done(progress.batchId, int(progress.numInputRows), progress.observedMetrics)
            self._log_batch(progress)

    def batch_done(self, batch_id: int, rows: int, metrics: Mapping[str, Any]) -> None:
        """A hook for a job whose sink tells the summary nothing itself."""

    def _log_batch(self, progress: Any) -> None:
        rows_out, quarantined = self._written.pop(progress.batchId, (0, 0))
        seconds = (progress.batchDuration or 0) / 1000
        logger.info(
            "%s: batch %s, %s rows in, %s rows out, %s quarantined, %.1f s",
            self.job,
            progress.batchId,
            progress.numInputRows,
            rows_out,
            quarantined,
            seconds,
            extra=log_extra(
                "spark_job_batch", job=self.job, batch_id=progress.batchId,
                rows_in=int(progress.numInputRows), rows_out=rows_out,
                quarantined=quarantined, duration_s=seconds,
            ),
        )  # fmt: skip

    def line(self) -> str:
        replayed = f" ({self.replayed} already written, skipped)" if self.replayed else ""
        batches = f"{self.batches} batch{'' if self.batches == 1 else 'es'}"
        return (
            f"{self.job}: {batches}{replayed}, {self.rows_in} rows in, "
            f"{self.rows_out} rows out, {self.quarantined} quarantined"
        )


class ArchiveSummary(RunSummary):
    """The archive writes every row it reads; an undecodable one is its quarantine."""

    def batch_done(self, batch_id: int, rows: int, metrics: Mapping[str, Any]) -> None:
        seen = metrics.get("decoding")
        self.wrote(rows, int((seen["undecodable"] or 0) if seen is not None else 0), batch_id)
