"""An exactly-once Delta Lake sink for ``foreachBatch``, for every reader of the table.

Each micro-batch is one Delta commit, written with Delta's idempotent-write options:
``txnAppId`` (the streaming query's id, which Spark keeps in the checkpoint's
``metadata``: a restart keeps it, a new checkpoint gets a new one) and ``txnVersion``
(the batch id). The commit records that pair in the table's log, atomically with the
files it adds, and Delta skips a write whose pair the log already holds at that version
or later: a batch Spark replays after a driver or executor crash is written once. Files
of a write that died before its commit are in no log entry, so no Delta reader (Spark,
``deltalake``, Trino...) ever sees them.

A query of a new checkpoint starts its batch ids over at 0 with a new id, so it would
archive the topics again: the archive refuses a new checkpoint on a table that has a
log (``spark_jobs.archive.refuse_reused_path``), as it does on a Parquet folder.

Why a batch's failure is re-raised short: Spark tells a query stopped mid-batch from a
failed one by matching the Python error's text against a regex,
``py4j.protocol.Py4JJavaError: An error occurred while calling((.|\\r\\n|\\r|\\n)*)...``
(``StreamExecution.isInterruptionException``), which Java matches by recursion, one
stack frame per character. A Delta write's Py4JJavaError holds whole Java stack traces,
tens of thousands of characters: the regex overflows the stream thread's stack, and the
query dies of a ``StackOverflowError`` in ``java.util.regex.Pattern`` instead of
stopping, or instead of saying what failed. :func:`short_failure` keeps the causes'
first lines, a few hundred characters, and the Py4J prefix only for an interruption,
so a stop stays a stop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.sql import DataFrame

from relay.core.log_fields import log_extra
from relay.errors import RelayError
from spark_jobs.spark_session import streaming_query_id

logger = logging.getLogger(__name__)

# The Java exceptions Spark takes for a stop (StreamExecution.IO_EXCEPTION_NAMES).
_INTERRUPTIONS = (
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
)
_PY4J_PREFIX = "py4j.protocol.Py4JJavaError: "
_CAUSES = 6
_CAUSE_CHARS = 300


class DeltaWriteError(RelayError):
    """A micro-batch could not be committed to the Delta table."""


class DeltaBatchSink:
    """The ``foreachBatch`` function appending each batch to the Delta table at ``path``
    exactly once (see module doc)."""

    def __init__(self, path: str, partition_by: Sequence[str] = ()) -> None:
        self.path = path
        self.partition_by = tuple(partition_by)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        app_id = streaming_query_id(batch)
        writer = (
            batch.write.format("delta")
            .mode("append")
            .option("txnAppId", app_id)
            .option("txnVersion", batch_id)
        )
        try:
            writer.partitionBy(*self.partition_by).save(self.path)
        except Py4JJavaError as exc:
            logger.debug(
                "delta batch %s failed",
                batch_id,
                exc_info=True,
                extra=log_extra("spark_delta_batch_failed", batch_id=batch_id, path=self.path),
            )
            # from None: the chained Py4JJavaError's text is what overflows (module doc).
            raise DeltaWriteError(short_failure(exc, f"batch {batch_id} to {self.path}")) from None


def short_failure(exc: Py4JJavaError, what: str) -> str:
    """``exc`` in a few lines: what failed and its innermost cause (the line a job's
    failure shows), then each Java cause's first line, outermost first."""
    causes = _java_causes(exc.java_exception)
    head = f"Delta write of {what} failed: {causes[-1] if causes else exc.errmsg}"
    if any(cause.startswith(_INTERRUPTIONS) for cause in causes):
        head = f"{_PY4J_PREFIX}{str(exc.errmsg).strip()} ({head}, interrupted)"
    return "\n".join([head, *causes])


def _java_causes(throwable: Any) -> list[str]:
    causes: list[str] = []
    while throwable is not None and len(causes) < _CAUSES:
        first = (str(throwable.toString()).splitlines() or [""])[0]
        causes.append(first[:_CAUSE_CHARS])
        throwable = throwable.getCause()
    return causes
