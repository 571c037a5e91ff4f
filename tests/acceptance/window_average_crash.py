"""``python -m tests.acceptance.window_average_crash POINT ARGS...``: job (b)'s driver, which kills
its own process group (the Python driver and its JVM) with SIGKILL at one crash point of
job (b) (docs/design.md §8), in the first micro-batch that emits windows:

* ``D``: the batch's offsets are logged, nothing else is done (kill on entering the
  batch, batch 1);
* ``C``: the batch's window state is saved (the aggregation ran), no sink written;
* ``A``: the averages' Kafka transaction committed, the Postgres counter not;
* ``B``: both sinks committed, Spark's commit log not.

The job itself is unchanged: the points are wrapped around it from outside.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from spark_jobs import window_average
from spark_jobs.kafka_sink import KafkaBatchSink, Record
from spark_jobs.postgres_sink import PostgresBatchSink, Write


def die() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def install(point: str) -> None:
    emitting: list[int] = []  # the batch that emits windows, once known
    job_writer, kafka_commit, pg_commit = (
        window_average.batch_writer, KafkaBatchSink.commit, PostgresBatchSink.commit,
    )  # fmt: skip

    def batch_writer(*args: Any) -> Callable[[Any, int], None]:
        inner = job_writer(*args)

        def write_batch(batch: Any, batch_id: int) -> None:
            if point == "D" and batch_id == 1:
                die()
            inner(batch, batch_id)

        return write_batch

    def commit_averages(
        self: KafkaBatchSink, batch_id: int, records: Sequence[Record], query_id: str
    ) -> bool:
        if records and not emitting:
            emitting.append(batch_id)
        if point == "C" and emitting == [batch_id]:
            die()
        done = kafka_commit(self, batch_id, records, query_id)
        if point == "A" and emitting == [batch_id]:
            die()
        return done

    def commit_counter(self: PostgresBatchSink, batch_id: int, write: Write, query_id: str) -> bool:
        done = pg_commit(self, batch_id, write, query_id)
        if point == "B" and emitting == [batch_id]:
            die()
        return done

    window_average.batch_writer = batch_writer  # type: ignore[assignment]
    KafkaBatchSink.commit = commit_averages  # type: ignore[method-assign]
    PostgresBatchSink.commit = commit_counter  # type: ignore[method-assign]


if __name__ == "__main__":
    install(sys.argv[1])
    window_average.main(sys.argv[2:])
