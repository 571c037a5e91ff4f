"""Job (c): archive every event to Parquet or Delta Lake, partitioned by date.

Spark's file sink is exactly once by itself, for readers through Spark only: each
micro-batch's files are listed in the sink's ``_spark_metadata`` log only when the batch
commits, and readers of the folder through Spark use that log, so files of a batch that
died half-way are never seen by them; other readers (pyarrow, Trino...) list the folder
and see those files too. ``--output-format delta`` writes a Delta table instead
(:mod:`spark_jobs.delta_sink`): each batch one idempotent commit, once for every reader.

``--backfill`` is a one-off batch job instead: ``spark.read.format("kafka")`` over a
fixed offset range (``--starting-offsets`` to ``--ending-offsets``, each ``earliest``,
``latest`` or Spark's per-partition JSON) into a folder of its own. Not the streaming
archive's folder: readers there see only the files its ``_spark_metadata`` log lists,
so backfilled files would be invisible. The folder must not exist yet, so running the
same backfill twice fails instead of archiving its events twice.

Nothing is left out: a record that cannot be decoded is archived all the same, with
its ``error`` and its raw ``value`` (the archive's quarantine: ``error IS NOT NULL``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from relay.core.settings import KafkaValue
from relay.errors import RelayError
from spark_jobs.decoding import VALUE_FORMATS, decode_events, observe_decoding
from spark_jobs.delta_sink import DeltaBatchSink
from spark_jobs.job import (
    add_batch_limit_option,
    add_common_options,
    await_query,
    job_session,
    kafka_clients,
    max_offsets_per_trigger,
    registry_access,
    report_decoding,
    run,
)
from spark_jobs.preflight import (
    SCHEMAS_HELP,
    checkpoint_folder,
    new_folder,
    offsets,
    schemas_folder,
)
from spark_jobs.registry_schemas import RegistryAccess, planned_schemas
from spark_jobs.run_summary import ArchiveSummary, RunSummary
from spark_jobs.spark_session import MAX_OFFSETS_PER_TRIGGER, kafka_options, kafka_stream

OUTPUT_FORMATS = ("parquet", "delta")
# Where each output format keeps the log of what its streaming query committed.
_SINK_LOGS = {"parquet": "_spark_metadata", "delta": "_delta_log"}


def read_range(
    spark: SparkSession,
    bootstrap_servers: str,
    topics: str,
    starting: str,
    ending: str,
    kafka_settings: Mapping[str, KafkaValue] | None = None,
) -> DataFrame:
    """The records of ``topics`` (a regex) between two offset specs, as one batch."""
    return (
        spark.read.format("kafka")
        .options(**kafka_options(bootstrap_servers, kafka_settings))
        .option("subscribePattern", topics)
        .option("startingOffsets", starting)
        .option("endingOffsets", ending)
        .option("includeHeaders", "true")
        .load()
    )


def archive_rows(decoded: DataFrame) -> DataFrame:
    """Decoded events (corrupt ones included, with their error; each with its raw
    ``value``, so not even an undecodable one is lost) plus a ``date`` column."""
    return decoded.withColumn("date", F.to_date("timestamp"))


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topics: str,
    path: str,
    checkpoint: str,
    schemas: str | None,
    value_format: str = "auto",
    kafka_settings: Mapping[str, KafkaValue] | None = None,
    available_now: bool = False,
    max_offsets_per_trigger: int | None = MAX_OFFSETS_PER_TRIGGER,
    registry: RegistryAccess | None = None,
    output_format: str = "parquet",
) -> Any:
    refuse_reused_path(spark, path, checkpoint, output_format)
    options = kafka_options(bootstrap_servers, kafka_settings)
    options.update(subscribePattern=topics, includeHeaders="true")
    source = kafka_stream(spark, options, max_offsets_per_trigger)
    decoded = decode_events(
        source, writer_schemas=schemas, value_format=value_format, keep_value=True,
        registry=registry,
        registry_schemas=planned_schemas(registry, value_format, topics, pattern=True),
    )  # fmt: skip
    rows = archive_rows(observe_decoding(decoded))
    stream = _sink(rows.writeStream, output_format, path).option("checkpointLocation", checkpoint)
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def _sink(stream: Any, output_format: str, path: str) -> Any:
    if output_format == "delta":
        return stream.foreachBatch(DeltaBatchSink(path, partition_by=["date"]))
    return stream.format("parquet").partitionBy("date").option("path", path)


class ReusedArchivePathError(RelayError):
    """The archive folder holds another streaming query's files, and the checkpoint is new."""


def refuse_reused_path(
    spark: Any, path: str, checkpoint: str, output_format: str = "parquet"
) -> None:
    """A new checkpoint starts its batch ids over at 0, and Spark's file sink skips every
    batch id its ``_spark_metadata`` log already has: the new query's first batches
    would be dropped without a word. A Delta table's log keys batches by query id
    instead, so a new query would archive every event again. So a folder with a sink
    log takes only the checkpoint that wrote it."""
    sink_log = _SINK_LOGS[output_format]
    if _has_entries(spark, f"{path}/{sink_log}") and not _has_entries(
        spark, f"{checkpoint}/offsets"
    ):
        raise ReusedArchivePathError(
            f"the archive folder {path} was written by a streaming query of another "
            f"checkpoint, and {checkpoint} is new: its batches would be skipped as already "
            "written. Use a new --path (readers can read both folders), or the checkpoint "
            "that wrote this one"
        )


def _has_entries(spark: Any, folder: str) -> bool:
    # Through Hadoop's FileSystem, so HDFS and S3 folders are checked like local ones.
    jvm, conf = spark.sparkContext._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hadoop_path = jvm.org.apache.hadoop.fs.Path(folder)
    fs = hadoop_path.getFileSystem(conf)
    return bool(fs.exists(hadoop_path) and len(fs.listStatus(hadoop_path)) > 0)


def backfill(
    spark: Any,
    *,
    bootstrap_servers: str,
    topics: str,
    path: str,
    schemas: str | None,
    starting_offsets: str = "earliest",
    ending_offsets: str = "latest",
    value_format: str = "auto",
    kafka_settings: Mapping[str, KafkaValue] | None = None,
    registry: RegistryAccess | None = None,
    summary: RunSummary | None = None,
    output_format: str = "parquet",
) -> None:
    """Archive one offset range to ``path`` (which must not exist) and return; logs an
    error when most records could not be decoded (they are archived all the same, with
    their error: the archive's quarantine), and tells ``summary``."""
    from pyspark.sql import Observation

    records = read_range(
        spark, bootstrap_servers, topics, starting_offsets, ending_offsets, kafka_settings
    )
    decoded = decode_events(
        records, writer_schemas=schemas, value_format=value_format, keep_value=True,
        registry=registry,
        registry_schemas=planned_schemas(registry, value_format, topics, pattern=True),
    )  # fmt: skip
    seen = Observation("decoding")
    rows = archive_rows(observe_decoding(decoded, into=seen))
    rows.write.format(output_format).mode("errorifexists").partitionBy("date").save(path)
    counts = seen.get
    read, undecodable = counts.get("records") or 0, counts.get("undecodable") or 0
    if read:
        report_decoding("archive", read, undecodable, counts["first_error"])
    if summary is not None:
        summary.batches, summary.rows_in = 1, read
        summary.wrote(read, undecodable)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--topics", default=r"outbox\.event\..*", help="A topic regex.")
    parser.add_argument("--path", required=True, help="Archive folder (local, HDFS, S3...).")
    parser.add_argument("--checkpoint", help="Required unless --backfill.")
    parser.add_argument("--schemas", help=SCHEMAS_HELP)
    parser.add_argument(
        "--format",
        dest="value_format",
        choices=VALUE_FORMATS,
        default="auto",
        help="The values' format; auto (the default) tells Avro, registry Avro and JSON "
        "apart per record.",
    )
    parser.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="parquet",
        help="parquet (the default: exactly once for readers through Spark) or delta (a "
        "Delta Lake table: exactly once for every reader; needs delta-spark, see "
        "docs/spark.md).",
    )
    parser.add_argument("--available-now", action="store_true")
    add_batch_limit_option(parser)
    parser.add_argument(
        "--backfill", action="store_true", help="One batch read of an offset range, then stop."
    )
    parser.add_argument("--starting-offsets", default="earliest", help="With --backfill.")
    parser.add_argument("--ending-offsets", default="latest", help="With --backfill.")
    args = parser.parse_args(argv)
    check_locations(parser, args)
    kafka_settings = dict(kafka_clients(parser, args).settings)
    common = {"bootstrap_servers": args.bootstrap_servers, "topics": args.topics,
              "path": args.path, "value_format": args.value_format,
              "schemas": schemas_folder(parser, args.schemas, args.value_format, args.config),
              "kafka_settings": kafka_settings,
              "registry": registry_access(parser, args),
              "output_format": args.output_format}  # fmt: skip
    summary = ArchiveSummary("archive")

    def job() -> None:
        spark = job_session("archive", args.debug, delta=args.output_format == "delta")
        if args.backfill:
            backfill(
                spark,
                starting_offsets=args.starting_offsets,
                ending_offsets=args.ending_offsets,
                summary=summary,
                **common,
            )
            return
        query = start(
            spark,
            checkpoint=args.checkpoint,
            available_now=args.available_now,
            max_offsets_per_trigger=max_offsets_per_trigger(args),
            **common,
        )
        await_query(query, summary)

    run("archive", args.debug, job, summary)


def check_locations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The folders and offsets, before Spark starts: a backfill's folder must be new and
    its offsets Spark's, and it reads its range in one batch, so no batch limit; a
    streaming archive needs a checkpoint it can write."""
    if args.backfill:
        if args.max_offsets_per_trigger is not None:
            parser.error(
                "--max-offsets-per-trigger: a backfill reads its offset range in one batch "
                "(narrow the range with --starting-offsets and --ending-offsets instead)"
            )
        new_folder(parser, args.path, "--path")
        offsets(parser, args.starting_offsets, "--starting-offsets")
        offsets(parser, args.ending_offsets, "--ending-offsets")
        return
    if args.checkpoint is None:
        parser.error("--checkpoint is required (or pass --backfill)")
    checkpoint_folder(parser, args.checkpoint, "--checkpoint")


if __name__ == "__main__":
    main()
