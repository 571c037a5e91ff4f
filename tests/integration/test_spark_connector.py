"""Spark's own Kafka connector and spark-avro: pinned at pyspark's version, loaded from
the jar cache, offline once fetched, and a clear error when pyspark and a pin disagree."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")

from relay.artifacts.maven import Lock  # noqa: E402
from spark_jobs import spark_session  # noqa: E402

pytestmark = pytest.mark.spark


def test_the_connector_is_pinned_at_the_installed_pyspark_version() -> None:
    lock = Lock.load(spark_session.CONNECTOR_LOCK)
    assert lock.version_of(*spark_session.CONNECTOR) == pyspark.__version__
    # What pyspark ships is not fetched again (two versions of a jar on one classpath).
    shipped = {
        jar.name.rsplit("-", 1)[0] for jar in Path(pyspark.__file__).parent.glob("jars/*.jar")
    }
    assert not shipped & {a.name for a in lock.artifacts}
    assert {"kafka-clients", "commons-pool2"} <= {a.name for a in lock.artifacts}


def test_spark_avro_is_pinned_at_the_installed_pyspark_version() -> None:
    lock = Lock.load(spark_session.AVRO_LOCK)
    assert lock.version_of(*spark_session.AVRO) == pyspark.__version__
    shipped = {
        jar.name.rsplit("-", 1)[0] for jar in Path(pyspark.__file__).parent.glob("jars/*.jar")
    }
    assert not shipped & {a.name for a in lock.artifacts}  # avro itself comes with pyspark


def test_delta_is_pinned_for_the_installed_spark_minor_without_what_pyspark_ships(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lock = Lock.load(spark_session.DELTA_LOCK)
    minor = ".".join(pyspark.__version__.split(".")[:2])
    assert lock.version_of("io.delta", f"delta-spark_{minor}_2.13")
    shipped = {
        jar.name.rsplit("-", 1)[0] for jar in Path(pyspark.__file__).parent.glob("jars/*.jar")
    }
    assert not shipped & {a.name for a in lock.artifacts}
    assert "delta-storage" in {a.name for a in lock.artifacts}
    monkeypatch.setattr(spark_session.pyspark, "__version__", "9.9.9")
    with pytest.raises(spark_session.ConnectorVersionError, match=r"for Spark 9\.9"):
        spark_session.delta_jars()


def test_a_pyspark_of_another_version_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed = pyspark.__version__
    monkeypatch.setattr(spark_session.pyspark, "__version__", "9.9.9")
    with pytest.raises(spark_session.ConnectorVersionError) as caught:
        spark_session.connector_jars()
    assert "pyspark is 9.9.9" in str(caught.value)
    assert f"pyspark=={installed}" in str(caught.value)


def test_once_fetched_the_connector_loads_without_the_repository(
    spark: Any, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    monkeypatch.setenv("RELAY_MAVEN_REPOSITORY", f"http://127.0.0.1:{closed}")

    jars = spark_session.connector_jars()

    loaded = spark.sparkContext.getConf().get("spark.jars").split(",")
    assert sorted(loaded) == sorted(str(j) for j in jars)
    # The session reads with format("kafka") (an unknown topic: an empty frame).
    frame = (
        spark.read.format("kafka")
        .options(**spark_session.kafka_options(kafka_bootstrap))
        .option("assign", '{"absent-topic": []}')
        .load()
    )
    assert frame.columns[:4] == ["key", "value", "topic", "partition"]
    # And from_avro (spark-avro) decodes a schemaless Avro body.
    from pyspark.sql.avro.functions import from_avro

    schema = '{"type":"record","name":"R","fields":[{"name":"n","type":"long"}]}'
    body = spark.createDataFrame([(bytearray(b"\x54"),)], "body binary")  # zigzag 42
    [row] = body.select(from_avro("body", schema).alias("r")).collect()
    assert row.r.n == 42
