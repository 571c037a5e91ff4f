"""Job (b), the seed-001 task, exactly once.

Two streams of numbers; over a sliding time window, the average of the numbers goes to
the output (a Postgres table), and each window that holds more numbers than a threshold
increments a counter in an external Postgres database by one.

Why it is exactly once, and deterministic despite the seed's two sources of
nondeterminism:

* Reading order: both topics are one source whose offsets live in the Spark checkpoint,
  so a replayed micro-batch reads exactly the same records.
* Time: windows are on *event time* (the record's timestamp), not on processing time,
  and a window is emitted once, when the watermark closes it (append mode).
* The external effects (the window's row and the counter increment) commit in one
  Postgres transaction together with the batch marker, so a replay writes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.postgres_sink import PostgresBatchSink
from spark_jobs.secrets import DATABASE_URL_HELP, resolve_database_url
from spark_jobs.session import kafka_options, local_session

TABLES_DDL = (
    """CREATE TABLE IF NOT EXISTS window_averages (
        window_start timestamptz PRIMARY KEY,
        window_end   timestamptz NOT NULL,
        average      double precision NOT NULL,
        numbers      bigint NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS window_counters (
        name  text PRIMARY KEY,
        value bigint NOT NULL DEFAULT 0
    )""",
)


def window_averages(
    numbers: DataFrame, *, length: str, slide: str, lateness: str = "0 seconds"
) -> DataFrame:
    """Kafka rows whose value is a JSON number (or ``{"value": n}``) → one row per closed
    sliding window: ``window_start``, ``window_end``, ``average``, ``numbers``."""
    value = F.coalesce(
        F.get_json_object(F.col("value").cast("string"), "$.value"),
        F.col("value").cast("string"),
    ).cast("double")
    return (
        numbers.select(F.col("timestamp").alias("event_time"), value.alias("number"))
        .where("number IS NOT NULL")
        .withWatermark("event_time", lateness)
        .groupBy(F.window("event_time", length, slide))
        .agg(F.avg("number").alias("average"), F.count("number").alias("numbers"))
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "average",
            "numbers",
        )
    )


def batch_writer(
    sink: PostgresBatchSink, threshold: int, counter: str
) -> Callable[[DataFrame, int], None]:
    def write_batch(batch: DataFrame, batch_id: int) -> None:
        windows = batch.collect()

        def write(conn: psycopg.Connection[Any]) -> int:
            with conn.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO window_averages VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (window_start) DO NOTHING",
                    [(w.window_start, w.window_end, w.average, w.numbers) for w in windows],
                )
            crowded = sum(1 for w in windows if w.numbers > threshold)
            conn.execute(
                "INSERT INTO window_counters (name, value) VALUES (%s, %s) "
                "ON CONFLICT (name) DO UPDATE SET value = window_counters.value + EXCLUDED.value",
                (counter, crowded),
            )
            return len(windows)

        sink.commit(batch_id, write)

    return write_batch


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topics: Sequence[str],
    database_url: str,
    checkpoint: str,
    length: str = "10 seconds",
    slide: str = "5 seconds",
    threshold: int = 10,
    counter: str = "crowded_windows",
    available_now: bool = False,
) -> Any:
    with psycopg.connect(database_url, autocommit=True) as conn:
        for ddl in TABLES_DDL:
            conn.execute(ddl)
    sink = PostgresBatchSink(database_url, f"window-average:{counter}")
    sink.ensure_tables()
    numbers = (
        spark.readStream.format("kafka")
        .options(**kafka_options(bootstrap_servers))
        .option("subscribe", ",".join(topics))
        .option("startingOffsets", "earliest")
        .load()
    )
    stream = (
        window_averages(numbers, length=length, slide=slide)
        .writeStream.outputMode("append")
        .foreachBatch(batch_writer(sink, threshold, counter))
        .option("checkpointLocation", checkpoint)
    )
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topics", required=True, help="Two (or more) comma-separated topics.")
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--length", default="10 seconds")
    parser.add_argument("--slide", default="5 seconds")
    parser.add_argument("--threshold", type=int, default=10)
    parser.add_argument("--available-now", action="store_true")
    args = parser.parse_args(argv)
    query = start(
        local_session("window-average"),
        bootstrap_servers=args.bootstrap_servers,
        topics=args.topics.split(","),
        database_url=resolve_database_url(parser, args.database_url),
        checkpoint=args.checkpoint,
        length=args.length,
        slide=args.slide,
        threshold=args.threshold,
        available_now=args.available_now,
    )
    query.awaitTermination()


if __name__ == "__main__":
    main()
