"""A Delta batch's failure, re-raised short enough for Spark's interruption regex (which
overflows the stream thread's stack on a long text), and still a stop when it was one."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

pytest.importorskip("pyspark")

from py4j.protocol import Py4JJavaError

from spark_jobs.delta_sink import short_failure
from spark_jobs.job import failure_reason

# Spark's StreamExecution.PROXY_ERROR, as pyspark 4.2.0's spark-sql jar builds it.
PROXY_ERROR = re.compile(
    r"py4j.protocol.Py4JJavaError: An error occurred while calling((.|\r\n|\r|\n)*)"
    r"(java.lang.InterruptedException|java.io.InterruptedIOException|"
    r"java.nio.channels.ClosedByInterruptException)"
)


@dataclass
class Throwable:
    """A JVM throwable as py4j hands it over; its text many lines long (a Delta error
    may quote a whole plan)."""

    text: str
    cause: Throwable | None = None
    _target_id: str = "o1"  # py4j's reference to the object in the JVM

    def toString(self) -> str:  # Java's names, as py4j calls them
        return self.text + "\n" + "\tat some.Frame.method(Frame.java:1)\n" * 2000

    def getCause(self) -> Throwable | None:
        return self.cause


def failure(root: Throwable) -> Py4JJavaError:
    return Py4JJavaError("An error occurred while calling o321.save.\n", root)


def test_a_failure_keeps_its_causes_first_lines_and_no_py4j_prefix() -> None:
    root = Throwable(
        "org.apache.spark.SparkException: Job aborted.",
        Throwable("java.io.IOException: No space left on device"),
    )
    text = short_failure(failure(root), "batch 7 to /data/t")
    assert text.splitlines() == [
        "Delta write of batch 7 to /data/t failed: java.io.IOException: No space left on device",
        "org.apache.spark.SparkException: Job aborted.",
        "java.io.IOException: No space left on device",
    ]
    assert PROXY_ERROR.search(text) is None  # a failure, not a stop


def test_an_interrupted_write_stays_a_stop_for_spark_and_short() -> None:
    root = Throwable(
        "org.apache.spark.SparkException: Job 3 cancelled",
        Throwable("java.lang.InterruptedException"),
    )
    text = short_failure(failure(root), "batch 2 to /data/t")
    assert PROXY_ERROR.search(text)
    assert len(text) < 1000


def test_the_job_shows_its_innermost_cause_in_its_one_line() -> None:
    root = Throwable(
        "org.apache.spark.SparkException: Job aborted.", Throwable("java.io.IOException: disk full")
    )
    raised = "spark_jobs.delta_sink.DeltaWriteError: " + short_failure(
        failure(root), "batch 7 to /t"
    )
    text = f'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n{raised}'
    assert failure_reason(RuntimeError(text)) == (
        "DeltaWriteError: Delta write of batch 7 to /t failed: java.io.IOException: disk full"
    )
