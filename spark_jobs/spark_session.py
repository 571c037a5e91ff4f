"""Spark sessions for the jobs, with Spark's own Kafka connector and Avro functions on
the classpath.

The connector (``spark-sql-kafka-0-10_2.13``) and ``spark-avro_2.13`` (``from_avro``)
must be the same version as pyspark. A local session loads them, and the jars they need
that pyspark does not ship, from the pinned-jar cache (:mod:`relay.artifacts.maven`,
locks ``spark-kafka`` and ``spark-avro``): downloaded and checksum-verified on first
use, offline after that. Under ``spark-submit`` the cluster provides them instead
(``--packages``, see the README). A session asked for Delta Lake (the archive's
``--output-format delta``) gets delta-spark the same way, lock ``delta``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyspark
from pyspark import SparkConf, SparkContext
from pyspark.sql import DataFrame, SparkSession

from relay.artifacts.maven import Lock, fetch_lock
from relay.core.log_fields import log_extra
from relay.core.settings import KafkaValue
from relay.errors import RelayError
from spark_jobs.kafka_clients import KafkaClients, connection_settings

logger = logging.getLogger(__name__)

CONNECTOR_LOCK = "spark-kafka"
CONNECTOR = ("org.apache.spark", "spark-sql-kafka-0-10_2.13")
AVRO_LOCK = "spark-avro"
AVRO = ("org.apache.spark", "spark-avro_2.13")
DELTA_LOCK = "delta"
# Delta builds one delta-spark per Spark minor version: the artifact names it.
DELTA_ARTIFACT_PREFIX = "delta-spark_"
# A session that writes Delta: its SQL extension and catalog (spark-submit's --conf wins).
DELTA_DEFAULTS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}

# The records a micro-batch reads at most, by default (``maxOffsetsPerTrigger``): every
# job starts from ``earliest``, so without a limit batch 0 of a backlog is the whole
# topic, at once, in the executors' and the sinks' memory.
MAX_OFFSETS_PER_TRIGGER = 100_000

# Java versions Spark 4 runs on, newest first.
_JVM_DIRS = ("/usr/lib/jvm/java-21-openjdk-amd64", "/usr/lib/jvm/java-17-openjdk-amd64")


class ConnectorVersionError(RelayError):
    """pyspark and the pinned Kafka connector are not the same Spark version."""


def connector_jars() -> list[Path]:
    """The jars of the Kafka connector and of spark-avro for the installed pyspark,
    fetched into the cache if missing. Spark refuses a connector of another version at
    query time, with an obscure error; this says what is wrong up front."""
    jars: list[Path] = []
    for lock_name, coordinates, what in (
        (CONNECTOR_LOCK, CONNECTOR, "Kafka connector"),
        (AVRO_LOCK, AVRO, "spark-avro"),
    ):
        lock = Lock.load(lock_name)
        pinned = lock.version_of(*coordinates)
        if pinned != pyspark.__version__:
            raise ConnectorVersionError(
                f"pyspark is {pyspark.__version__} but the pinned {what} is {pinned}: "
                f"install pyspark=={pinned} (pyproject.toml pins it), or re-lock "
                f"relay/artifacts/{lock_name}.lock for a version Maven Central serves"
            )
        jars += fetch_lock(lock)
    return jars


def delta_jars() -> list[Path]:
    """The jars of delta-spark (lock ``delta``) for the installed pyspark, fetched into
    the cache if missing; a lock made for another Spark minor version is refused."""
    lock = Lock.load(DELTA_LOCK)
    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    built_for = [a.name for a in lock.artifacts if a.name.startswith(DELTA_ARTIFACT_PREFIX)]
    if built_for != [f"{DELTA_ARTIFACT_PREFIX}{spark_minor}_2.13"]:
        raise ConnectorVersionError(
            f"pyspark is {pyspark.__version__} but the pinned Delta Lake is {built_for}: "
            f"re-lock relay/artifacts/{DELTA_LOCK}.lock for Spark {spark_minor}"
        )
    return fetch_lock(lock)


# What a job's session takes for each key its user did not set: spark-submit's --conf
# and spark-defaults.conf win.
SESSION_DEFAULTS = {
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.showConsoleProgress": "false",  # a job's log is not a terminal
    "spark.sql.session.timeZone": "UTC",
}
# An embedded run (``python -m``) also: one machine, maybe many jobs, no one at its UI.
EMBEDDED_DEFAULTS = {"spark.master": "local[2]", "spark.ui.enabled": "false"}


def submitted() -> bool:
    """Whether ``spark-submit`` launched this driver (it hands pyspark a running JVM)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def local_spark_session(
    app_name: str, *, master: str | None = None, delta: bool = False, **conf: Any
) -> SparkSession:
    """The job's session. Under ``spark-submit`` it keeps the master and every setting it
    was given, adding :data:`SESSION_DEFAULTS` only for the keys not set; run with
    ``python`` it is embedded, ``local[2]`` with the UI off, the connector's jars from
    the pinned cache. ``delta`` adds Delta Lake (:data:`DELTA_DEFAULTS`; embedded, its
    jars too). ``master`` and ``conf`` are the caller's own: they always win."""
    # Workers must run this interpreter: it has pyarrow and confluent-kafka.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if "JAVA_HOME" not in os.environ:
        found = next((d for d in _JVM_DIRS if Path(d, "bin", "java").exists()), None)
        if found:
            os.environ["JAVA_HOME"] = found
    settings = {**_defaults(delta), **({"spark.master": master} if master else {}), **conf}
    builder = SparkSession.builder.appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _defaults(delta: bool = False) -> dict[str, str]:
    wanted = {**SESSION_DEFAULTS, **(DELTA_DEFAULTS if delta else {})}
    if not submitted():
        jars = connector_jars() + (delta_jars() if delta else [])
        logger.debug(
            "Kafka connector and spark-avro jars: %s",
            jars,
            extra=log_extra("spark_connector_jars", jars=[str(p) for p in jars]),
        )
        return {**wanted, **EMBEDDED_DEFAULTS, "spark.jars": ",".join(map(str, jars))}
    # spark-submit's JVM is up, its settings in its system properties, which a SparkConf
    # loads; --packages (or --jars) brought the connectors (and delta-spark).
    SparkContext._ensure_initialized()
    given = {key for key, _ in SparkConf().getAll()}
    return {key: value for key, value in wanted.items() if key not in given}


def kafka_options(
    bootstrap_servers: str, kafka_settings: Mapping[str, KafkaValue] | None = None
) -> dict[str, str]:
    """Options every job gives ``format("kafka")``: the cluster, its connection and
    security settings (librdkafka names, the relay's, mapped to the Java client's: see
    :mod:`spark_jobs.kafka_clients`), and ``read_committed``. The connector's consumers
    default to ``read_uncommitted``, which would hand a job the records of transactions
    the relay aborted: the relay writes in transactions, so its readers read committed."""
    return KafkaClients(
        bootstrap_servers, connection_settings(kafka_settings or {})
    ).spark_options()


def kafka_stream(
    spark: Any, options: Mapping[str, str], max_offsets_per_trigger: int | None
) -> DataFrame:
    """A streaming Kafka source from ``earliest``, with the job's ``options`` (the
    cluster's, what to subscribe to) and at most ``max_offsets_per_trigger`` records a
    micro-batch (None: no limit)."""
    limit = (
        {"maxOffsetsPerTrigger": str(max_offsets_per_trigger)} if max_offsets_per_trigger else {}
    )
    source = spark.readStream.format("kafka").options(**options, **limit)
    return source.option("startingOffsets", "earliest").load()  # type: ignore[no-any-return]


def streaming_query_id(batch: DataFrame) -> str:
    """The id of the streaming query a ``foreachBatch`` batch belongs to. Spark keeps it
    in the checkpoint's ``metadata``: a restart keeps it, a new checkpoint gets a new
    one, which is what tells a sink's replayed batch from another query's batch."""
    query_id = batch.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    if not query_id:
        raise RelayError("not in a streaming query's foreachBatch: no query id to key a sink on")
    return query_id
