"""The Python Kafka source on a real local Spark session and a real broker, checked
against the behaviour documented for Spark's built-in Kafka source."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import SparkSession  # noqa: E402

from spark_jobs.kafka_source import kafka_schema  # noqa: E402
from spark_jobs.session import read_kafka  # noqa: E402

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parent.parent


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
    query = start_available_now(spark, bootstrap, topic, checkpoint, out, **options)
    assert query.exception() is None, query.exception()
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def start_available_now(
    spark: SparkSession, bootstrap: str, topic: str, checkpoint: Path, out: Path, **options: str
) -> Any:
    """One AvailableNow run into Parquet, to its end; the finished query."""
    frame = read_kafka(spark, subscribe=topic, **{"kafka.bootstrap.servers": bootstrap, **options})
    query = (
        frame.selectExpr("CAST(value AS STRING) AS value", "partition", "offset")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    # A failed query raises here; the caller reads query.exception().
    with contextlib.suppress(Exception):
        query.awaitTermination(300)
    return query


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
    failed = start_available_now(
        spark, kafka_bootstrap, topic, tmp_path / "c", tmp_path / "o", maxOffsetsPerTrigger="x"
    )
    assert "maxOffsetsPerTrigger must be a positive integer" in str(failed.exception())


def relay_records(registry: Any, count: int) -> list[Any]:
    """Records exactly as the relay encodes them (Avro single-object + headers)."""
    from datetime import UTC, datetime

    from relay.encoding import RecordEncoder
    from relay.model import OutboxEvent
    from relay.subscribers import Subscriber

    encoder, subscriber = RecordEncoder(registry), Subscriber("s", topic="unused")
    return [
        encoder.encode(
            OutboxEvent(
                transaction_id=1000 + i,
                position=i + 1,
                message_id=uuid.uuid4(),
                aggregate_type="order",
                aggregate_id=f"o-{i}",
                aggregate_version=None,
                event_type="OrderPlaced",
                payload={"order_id": f"o-{i}", "customer_id": "c", "amount_cents": i},
                headers={},
                occurred_at=datetime.now(UTC),
            ),
            subscriber,
        )
        for i in range(count)
    ]


def test_avro_values_decode_resolve_to_the_reader_schema_and_corrupt_ones_are_kept(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path, registry: Any
) -> None:
    import json

    from spark_jobs.decoding import decode_events, split_corrupt

    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": str(uuid.uuid4())}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for record in relay_records(registry, 20):
        producer.produce(topic, record.value, record.key, headers=record.headers)
    producer.produce(topic, b"\xc3\x01garbage!", b"bad", headers=[("id", b"x")])
    producer.commit_transaction(30)
    # The job's reader schema has evolved: a new field with a default, one field gone.
    readers = tmp_path / "readers"
    readers.mkdir()
    (readers / "OrderPlaced.avsc").write_text(
        json.dumps(
            {
                "type": "record",
                "name": "OrderPlaced",
                "namespace": "demo.orders",
                "fields": [
                    {"name": "order_id", "type": "string"},
                    {"name": "amount_cents", "type": "long"},
                    {"name": "channel", "type": "string", "default": "web"},
                ],
            }
        )
    )
    source = read_kafka(
        spark,
        subscribe=topic,
        startingOffsets="earliest",
        includeHeaders="true",
        **{"kafka.bootstrap.servers": kafka_bootstrap},
    )
    decoded = decode_events(source, writer_schemas=REPO / "schemas", reader_schemas=readers)
    name = f"decoded_{uuid.uuid4().hex[:8]}"
    query = decoded.writeStream.format("memory").queryName(name).trigger(availableNow=True).start()
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    events, corrupt = split_corrupt(spark.table(name))
    rows = events.orderBy("position").collect()
    assert len(rows) == 20
    assert [json.loads(r.payload) for r in rows][:2] == [
        {"order_id": "o-0", "amount_cents": 0, "channel": "web"},
        {"order_id": "o-1", "amount_cents": 1, "channel": "web"},
    ]
    assert rows[0].event_type == "OrderPlaced" and rows[0].transaction_id == 1000
    [bad] = corrupt.collect()
    assert bad.key == "bad" and "fingerprint" in bad.error


def test_assign_reads_only_the_named_partitions(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    import json

    produce(kafka_bootstrap, topic, [f"v{i}" for i in range(300)])
    frame = read_kafka(
        spark,
        assign=json.dumps({topic: [0, 2]}),
        startingOffsets="earliest",
        **{"kafka.bootstrap.servers": kafka_bootstrap},
    )
    name = f"assigned_{uuid.uuid4().hex[:8]}"
    query = frame.writeStream.format("memory").queryName(name).trigger(availableNow=True).start()
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    partitions = {r.partition for r in spark.table(name).select("partition").collect()}
    assert partitions == {0, 2}


def test_records_deleted_before_they_were_read_fail_the_query_unless_told_otherwise(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """Real retention: DeleteRecords on Apache Kafka, then failOnDataLoss either way."""
    from confluent_kafka import TopicPartition

    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    produce(kafka_bootstrap, topic, [f"v{i}" for i in range(90)])
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out, startingOffsets="earliest")
    produce(kafka_bootstrap, topic, [f"lost{i}" for i in range(90)])
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    ends = [TopicPartition(topic, p, -1) for p in range(3)]  # -1: up to the high watermark
    for future in admin.delete_records(ends).values():
        future.result(30)

    failed = start_available_now(spark, kafka_bootstrap, topic, checkpoint, out)
    assert "were deleted" in str(failed.exception())
    assert "failOnDataLoss" in str(failed.exception())

    produce(kafka_bootstrap, topic, ["after"])
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out, failOnDataLoss="false")
    assert sorted(values_in(spark, out)) == sorted([f"v{i}" for i in range(90)] + ["after"])


def test_partitions_added_to_a_topic_are_read_from_their_start(
    spark: SparkSession, kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """Real CreatePartitions on Apache Kafka while the query's checkpoint knows 3."""
    from confluent_kafka.admin import NewPartitions

    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    produce(kafka_bootstrap, topic, ["before"])
    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out, startingOffsets="earliest")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_partitions([NewPartitions(topic, 5)]).values():
        future.result(30)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for partition in (3, 4):
        producer.produce(topic, f"new-{partition}".encode(), partition=partition)
    assert producer.flush(30) == 0

    run_available_now(spark, kafka_bootstrap, topic, checkpoint, out)
    rows = spark.read.parquet(str(out)).collect()
    assert sorted((r.value, r.partition) for r in rows if r.value.startswith("new")) == [
        ("new-3", 3),
        ("new-4", 4),
    ]
    assert len(rows) == 3
