"""What a job's run did, in one line at its end: batches, rows in, rows out, quarantined.

The streaming queries' progress gives the batches and the rows read; only the job's own
sink knows what it wrote and what it quarantined (a replayed batch writes nothing), so
the batch writers add those as each batch commits. The archive, whose sink is Spark's
file sink, counts from the progress alone: every row read is written, and an
undecodable one is archived with its error (its quarantine)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

# Listeners hear of a query's last progress after it ended, asynchronously.
_LAST_PROGRESS_S = 60.0


class RunSummary(StreamingQueryListener):
    """Counts one run of a job; :meth:`line` says it."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.batches = 0
        self.rows_in = 0
        self.rows_out = 0
        self.quarantined = 0
        self.replayed = 0  # batches a sink had already written: nothing written again
        self._started = threading.Event()
        self._ended = threading.Event()

    def wrote(self, rows_out: int, quarantined: int) -> None:
        """A batch committed ``rows_out`` rows and quarantined ``quarantined``."""
        self.rows_out += rows_out
        self.quarantined += quarantined

    def skipped_replay(self) -> None:
        self.replayed += 1

    def onQueryStarted(self, event: Any) -> None:
        self._started.set()

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        self._ended.set()

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        self.batches += 1
        self.rows_in += int(progress.numInputRows)
        self.progressed(int(progress.numInputRows), progress.observedMetrics)

    def progressed(self, rows: int, metrics: Mapping[str, Any]) -> None:
        """A hook for a job whose sink reports nothing to the summary itself."""

    def line(self) -> str:
        if self._started.is_set() and not self._ended.wait(_LAST_PROGRESS_S):
            logger.warning(
                "%s: the summary may miss the last batch's progress",
                self.job,
                extra=log_extra("spark_job_summary_incomplete", job=self.job),
            )
        replayed = f" ({self.replayed} already written, skipped)" if self.replayed else ""
        batches = f"{self.batches} batch{'' if self.batches == 1 else 'es'}"
        return (
            f"{self.job}: {batches}{replayed}, {self.rows_in} rows in, "
            f"{self.rows_out} rows out, {self.quarantined} quarantined"
        )


class ArchiveSummary(RunSummary):
    """The archive writes every row it reads; an undecodable one is its quarantine."""

    def progressed(self, rows: int, metrics: Mapping[str, Any]) -> None:
        seen = metrics.get("decoding")
        self.wrote(rows, int((seen["undecodable"] or 0) if seen is not None else 0))
