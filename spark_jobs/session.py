"""Spark sessions for the jobs, and the Kafka reader that works with or without the jar."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession

from spark_jobs.kafka_source import FORMAT, KafkaSource

# Java versions Spark 4 runs on, newest first.
_JVM_DIRS = ("/usr/lib/jvm/java-21-openjdk-amd64", "/usr/lib/jvm/java-17-openjdk-amd64")


def local_session(app_name: str, *, master: str | None = None, **conf: Any) -> SparkSession:
    """The job's session: ``local[2]`` (the embedded default) when run with ``python``,
    or whatever master ``spark-submit`` was given (it launches us with a gateway)."""
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[2]"
    # Workers must run this interpreter: it has pyarrow and confluent-kafka.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if "JAVA_HOME" not in os.environ:
        found = next((d for d in _JVM_DIRS if Path(d, "bin", "java").exists()), None)
        if found:
            os.environ["JAVA_HOME"] = found
    builder = SparkSession.builder if master is None else SparkSession.builder.master(master)
    builder = (
        builder.appName(app_name)
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    return register(builder.getOrCreate())


def register(spark: SparkSession) -> SparkSession:
    spark.dataSource.register(KafkaSource)
    return spark


def read_kafka(spark: SparkSession, **options: str) -> DataFrame:
    """``readStream`` of Kafka: Spark's own connector when its jar is on the classpath,
    else this package's Python source, with the same options and the same columns."""
    try:
        return spark.readStream.format("kafka").options(**options).load()
    except AnalysisException as exc:
        if exc.getCondition() != "KAFKA_DATA_SOURCE_NOT_ENABLED":
            raise
    return spark.readStream.format(FORMAT).options(**options).load()
