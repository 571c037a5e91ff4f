"""Job (c): archive every event to Parquet, partitioned by date.

Spark's file sink is exactly once by itself: each micro-batch's files are listed in the
sink's ``_spark_metadata`` log only when the batch commits, and readers of the folder
through Spark use that log, so files of a batch that died half-way are never seen.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.decoding import decode_events
from spark_jobs.session import kafka_options, local_session


def archive_rows(decoded: DataFrame) -> DataFrame:
    """Decoded events (corrupt ones included, with their error) plus a ``date`` column."""
    return decoded.withColumn("date", F.to_date("timestamp"))


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topics: str,
    path: str,
    checkpoint: str,
    schemas: str,
    value_format: str = "avro",
    available_now: bool = False,
) -> Any:
    source = (
        spark.readStream.format("kafka")
        .options(**kafka_options(bootstrap_servers))
        .option("subscribePattern", topics)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
    )
    decoded = decode_events(source, writer_schemas=schemas, value_format=value_format)
    stream = (
        archive_rows(decoded)
        .writeStream.format("parquet")
        .partitionBy("date")
        .option("path", path)
        .option("checkpointLocation", checkpoint)
    )
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topics", default=r"outbox\.event\..*", help="A topic regex.")
    parser.add_argument("--path", required=True, help="Archive folder (local, HDFS, S3...).")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--schemas", default="schemas")
    parser.add_argument("--format", dest="value_format", choices=["avro", "json"], default="avro")
    parser.add_argument("--available-now", action="store_true")
    args = parser.parse_args(argv)
    query = start(
        local_session("outbox-archive"),
        bootstrap_servers=args.bootstrap_servers,
        topics=args.topics,
        path=args.path,
        checkpoint=args.checkpoint,
        schemas=args.schemas,
        value_format=args.value_format,
        available_now=args.available_now,
    )
    query.awaitTermination()


if __name__ == "__main__":
    main()
