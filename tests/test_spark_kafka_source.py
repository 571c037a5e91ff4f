"""The Python Kafka source on a real local Spark session and a real broker, checked
against the behaviour documented for Spark's built-in Kafka source."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import SparkSession  # noqa: E402

from spark_jobs.kafka_source import kafka_schema  # noqa: E402
from spark_jobs.session import local_session, read_kafka  # noqa: E402

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = local_session("outbox-relay-tests")
    yield session
    session.stop()


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    name = f"spark-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(name, 3, -1)]).values():
        future.result()
    return name


def produce(bootstrap: str, topic: str, values: list[str], per_transaction: int = 100) -> None:
    """Transactionally, as the relay writes: offsets then include commit markers."""
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"spark-test-{uuid.uuid4()}"}
    )
    producer.init_transactions(30)
    for i in range(0, len(values), per_transaction):
        producer.begin_transaction()
        for value in values[i : i + per_transaction]:
            producer.produce(topic, value.encode(), value.encode(), headers=[("h", b"x")])
        producer.commit_transaction(30)


def run_available_now(
    spark: SparkSession, bootstrap: str, topic: str, checkpoint: Path, out: Path, **options: str
) -> list[int]:
    """One AvailableNow run into Parquet; the rows of each micro-batch."""
    frame = read_kafka(spark, subscribe=topic, **{"kafka.bootstrap.servers": bootstrap, **options})
    query = (
        frame.selectExpr("CAST(value AS STRING) AS value", "partition", "offset")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def values_in(spark: SparkSession, out: Path) -> list[Any]:
    return [r.value for r in spark.read.parquet(str(out)).collect()]


def test_reads_everything_once_and_resumes_from_the_checkpoint(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    first = [f"v{i}" for i in range(1000)]
    produce(kafka_bootstrap, topic, first)
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out, startingOffsets="earliest")
    assert sorted(values_in(spark, out)) == sorted(first)

    more = [f"w{i}" for i in range(500)]
    produce(kafka_bootstrap, topic, more)
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out, startingOffsets="earliest")
    assert sorted(values_in(spark, out)) == sorted(first + more)


def test_max_offsets_per_trigger_bounds_each_batch(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    produce(kafka_bootstrap, topic, [f"v{i}" for i in range(900)])
    batches = run_available_now(
        spark,
        kafka_bootstrap,
        topic,
        tmp_path / "checkpoint",
        tmp_path / "out",
        startingOffsets="earliest",
        maxOffsetsPerTrigger="250",
    )
    assert sum(batches) == 900
    assert len(batches) >= 4 and max(batches) <= 250


def test_starting_offsets_latest_skips_what_was_there(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    produce(kafka_bootstrap, topic, ["old"])
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out)  # latest is the default
    produce(kafka_bootstrap, topic, ["new"])
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out)
    assert values_in(spark, out) == ["new"]


def test_columns_match_the_builtin_source_and_headers_are_opt_in(
    spark: SparkSession, kafka_bootstrap: str, topic: str
) -> None:
    options = {"subscribe": topic, "kafka.bootstrap.servers": kafka_bootstrap}
    plain = read_kafka(spark, **options)
    assert plain.schema == kafka_schema(False)
    assert [f.name for f in plain.schema] == [
        "key", "value", "topic", "partition", "offset", "timestamp", "timestampType",
    ]  # fmt: skip
    with_headers = read_kafka(spark, includeHeaders="true", **options)
    assert with_headers.schema.fieldNames()[-1] == "headers"


def test_bad_options_fail_with_a_message_naming_them(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    with pytest.raises(Exception, match="maxOffsetsPerTrigger must be a positive integer"):
        run_available_now(
            spark, kafka_bootstrap, topic, tmp_path / "c", tmp_path / "o", maxOffsetsPerTrigger="x"
        )
