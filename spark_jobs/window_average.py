"""Job (b), the sliding-window task (docs/design.md §8), exactly once.

Two streams of numbers; over a sliding time window, the average of the numbers goes to
the output stream (a Kafka topic), and each window that holds more numbers than a
threshold increments a counter in an external Postgres database by one. A record that is
not a finite number counts in no window: it is quarantined, with its reason, in the
sink's error table (``spark_corrupt_records``, in the counter's transaction) when the
last window that holds its time closes.

Why it is exactly once, and deterministic despite the task's two sources of
nondeterminism:

* Reading order: both topics are one source whose offsets live in the Spark checkpoint,
  so a replayed micro-batch reads exactly the same records.
* Time: windows are on *event time* (the record's timestamp), not on processing time,
  and a window is emitted once, when the watermark closes it (append mode).
* Each sink is exactly once on its own, so it does not matter which of them committed
  before a crash: the averages go out in one Kafka transaction per micro-batch that also
  records the batch id (:class:`KafkaBatchSink`), and the counter's increment commits in
  one Postgres transaction with its own batch marker (:class:`PostgresBatchSink`). A
  replayed batch (same id, same input, same state) skips whichever sink already has it.

The task's crash points, as they fall here (the tests kill -9 the driver at each):
(D) the batch's offsets are logged, nothing else; (C) the window state of the batch is
saved, no sink written; (A) the averages' transaction committed, the counter not;
(B) both sinks committed, Spark's commit log not. Each restart ends in the same state.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F

from relay.core.settings import KafkaValue
from spark_jobs.decoding import observe_decoding
from spark_jobs.job import await_query, job_session, run
from spark_jobs.kafka_clients import KafkaClients, connection_settings
from spark_jobs.kafka_sink import KafkaBatchSink, Record, ensure_topic
from spark_jobs.postgres_sink import PostgresBatchSink, connect, create_table
from spark_jobs.run_summary import RunSummary
from spark_jobs.sink_job_args import sink_job_options, sink_job_parser
from spark_jobs.spark_session import MAX_OFFSETS_PER_TRIGGER, kafka_stream, streaming_query_id

COUNTERS_DDL = """CREATE TABLE IF NOT EXISTS {table} (
    name  text PRIMARY KEY,
    value bigint NOT NULL DEFAULT 0
)"""


@dataclass(frozen=True)
class SlidingWindow:
    """Event-time windows ``length`` long, one starting every ``slide`` (Spark interval
    strings). A number up to ``lateness`` behind the newest one (over all the inputs)
    still counts; a later one is dropped."""

    length: str = "10 seconds"
    slide: str = "5 seconds"
    lateness: str = "0 seconds"


# The job's defaults, and its command line's.
DEFAULT_WINDOW = SlidingWindow()


def window_averages(numbers: DataFrame, window: SlidingWindow) -> DataFrame:
    """Kafka rows whose value is a JSON number (or ``{"value": n}``) → one row per closed
    sliding window: ``window_start``, ``window_end``, ``average``, ``numbers``, and
    ``rejected``: the records of the window that are not finite numbers, each with its
    place in Kafka and its ``error``, so the job can quarantine them. A record is in
    several sliding windows, but rejected in one only: the last, which closes last."""
    text = F.col("value").cast("string")
    # try_cast: under ANSI SQL (Spark 4's default) a cast of "abc" fails the whole query.
    value = F.coalesce(F.get_json_object(text, "$.value"), text).try_cast("double")
    number = F.col("number")
    shown = F.substring(F.coalesce("text", F.lit("null")), 1, 80)
    error = F.when(number.isNull(), F.concat(F.lit("not a number: "), shown)).when(
        F.isnan(number) | F.abs(number).eqNullSafe(float("inf")),
        F.concat(F.lit("not a finite number: "), shown),
    )
    parsed = numbers.select(
        F.col("timestamp").alias("event_time"), value.alias("number"), text.alias("text"),
        "topic", "partition", "offset", F.col("key").cast("string").alias("key"),
    ).withColumn("error", error)  # fmt: skip
    good = F.col("error").isNull()
    place = F.struct("topic", "partition", "offset", "key", "error", "event_time")
    last_slide = F.col("window.start") + F.expr(f"INTERVAL {window.slide}")
    return (
        observe_decoding(parsed, ~good, F.col("error"))
        .withWatermark("event_time", window.lateness)
        .groupBy(F.window("event_time", window.length, window.slide))
        .agg(
            F.avg(F.when(good, number)).alias("average"),
            F.count(F.when(good, number)).alias("numbers"),
            F.collect_list(F.when(~good, place)).alias("rejected"),
        )
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "average",
            "numbers",
            F.filter("rejected", lambda r: r["event_time"] < last_slide).alias("rejected"),
        )
    )


def average_record(window: Row) -> Record:
    """A closed window as an output record: keyed by its start, a JSON value; times in
    ISO-8601, in UTC with its offset (``+00:00``)."""
    start, end = _utc(window.window_start), _utc(window.window_end)
    value = {"window_start": start, "window_end": end, "average": window.average,
             "numbers": window.numbers}  # fmt: skip
    return start.encode(), json.dumps(value).encode()


def _utc(moment: datetime) -> str:
    # pyspark hands timestamps over as naive datetimes in the driver's local time.
    return moment.astimezone(UTC).isoformat()


def batch_writer(
    averages: KafkaBatchSink,
    counters: PostgresBatchSink,
    threshold: int,
    counter: str,
    summary: RunSummary | None = None,
) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: the averages of the closed windows in one Kafka
    transaction; the counter's increment and the windows' rejected records (to the
    sink's error table) in one Postgres transaction with the counter's marker."""

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        query_id = streaming_query_id(batch)
        # Before anything is written: a query of a new checkpoint fails here unless told
        # to take the counter over (its averages' marker is per query, see KafkaBatchSink).
        counters.claim(query_id)
        windows = batch.collect()  # runs the aggregation: the batch's state is saved here
        records = [average_record(w) for w in windows if w.numbers]
        sent = averages.commit(batch_id, records, query_id)
        crowded = sum(1 for w in windows if w.numbers > threshold)
        rejected = [r for w in windows for r in w.rejected]

        def increment(conn: psycopg.Connection[Any]) -> int:
            conn.execute(
                "INSERT INTO window_counters (name, value) VALUES (%s, %s) "
                "ON CONFLICT (name) DO UPDATE SET value = window_counters.value + EXCLUDED.value",
                (counter, crowded),
            )
            counters.write_corrupt(conn, batch_id, rejected)
            return crowded + len(rejected)

        counted = counters.commit(batch_id, increment, query_id)
        if summary is not None:
            summary.wrote(len(records) if sent else 0, len(rejected) if counted else 0, batch_id)
            if not (sent or counted):
                summary.skipped_replay()

    return write_batch


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topics: Sequence[str],
    output_topic: str,
    kafka_settings: Mapping[str, KafkaValue] | None = None,
    create_output_topic: bool = True,
    database_url: str,
    checkpoint: str,
    window: SlidingWindow = DEFAULT_WINDOW,
    threshold: int = 10,
    counter: str = "crowded_windows",
    available_now: bool = False,
    max_offsets_per_trigger: int | None = MAX_OFFSETS_PER_TRIGGER,
    reset_sink: bool = False,
    summary: RunSummary | None = None,
) -> Any:
    with connect(database_url, autocommit=True) as conn:
        create_table(conn, COUNTERS_DDL, "window_counters")
    counters = PostgresBatchSink(database_url, f"window-average:{counter}", take_over=reset_sink)
    counters.ensure_tables()
    clients = KafkaClients(bootstrap_servers, connection_settings(kafka_settings or {}))
    ensure_topic(clients, output_topic, create=create_output_topic, flag="--no-create-output-topic")
    averages = KafkaBatchSink(
        bootstrap_servers, output_topic, f"window-average.{output_topic}", clients.settings
    )
    options = {**clients.spark_options(), "subscribe": ",".join(topics)}
    numbers = kafka_stream(spark, options, max_offsets_per_trigger)
    stream = (
        window_averages(numbers, window)
        .writeStream.outputMode("append")
        .foreachBatch(batch_writer(averages, counters, threshold, counter, summary))
        .option("checkpointLocation", checkpoint)
    )
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = sink_job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--topics", required=True, help="Two (or more) comma-separated topics.")
    parser.add_argument("--output-topic", default="window-averages", help="Where averages go.")
    parser.add_argument("--length", default=DEFAULT_WINDOW.length)
    parser.add_argument("--slide", default=DEFAULT_WINDOW.slide)
    parser.add_argument(
        "--lateness",
        default=DEFAULT_WINDOW.lateness,
        help="How far behind the newest number (over both topics) a number may arrive and "
        "still count; later ones are dropped. Cover the skew between the two topics.",
    )
    parser.add_argument("--threshold", type=int, default=10)
    parser.add_argument(
        "--create-output-topic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Create the output topic when it does not exist (the default).",
    )
    args = parser.parse_args(argv)
    options = sink_job_options(parser, args)
    summary = RunSummary("window_average")

    def job() -> None:
        query = start(
            job_session("window_average", args.debug),
            topics=args.topics.split(","),
            output_topic=args.output_topic,
            create_output_topic=args.create_output_topic,
            window=SlidingWindow(args.length, args.slide, args.lateness),
            threshold=args.threshold,
            summary=summary,
            **options,
        )
        await_query(query, summary)

    run("window_average", args.debug, job, summary)


if __name__ == "__main__":
    main()
