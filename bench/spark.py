"""Spark's Kafka connector (``format("kafka")``) reading the relay's records, all in one run.

Records are what the relay writes (Avro single-object encoded ``OrderPlaced`` values,
the relay's headers), written transactionally to a 3-partition topic on the embedded
broker. Three readers, each reading every record once:

* baseline: one plain confluent-kafka consumer (read_committed, assign), no decoding;
* the connector alone: a streaming query, Trigger.AvailableNow into Spark's ``noop``
  sink, on local[2];
* the connector with decoding: the same query through ``spark_jobs.decoding``
  (fastavro in Arrow batches, writer schema by fingerprint).

Spark's times exclude the session start but include query planning. Each Spark query
runs once untimed first: that warms the JVM and the Python workers, which a
long-running job pays once. Then the three readers take turns, ``scale.repetitions``
rounds (bench/method.py): medians, with their ranges.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from pyspark.sql import DataFrame, SparkSession

from bench.harness import SCHEMAS, Figure, Scale, Stack, order_payload
from bench.method import interleave
from relay.schemas import SchemaFolder
from spark_jobs.decoding import decode_events
from spark_jobs.spark_session import kafka_options, local_spark_session

PARTITIONS = 3
TRANSACTION = 10_000


def fill(bootstrap: str, topic: str, records: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, -1)]).values():
        future.result()
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"bench-{topic}", "linger.ms": 20}
    )
    producer.init_transactions(30)
    registry = SchemaFolder.from_dir(SCHEMAS)
    for start in range(0, records, TRANSACTION):
        producer.begin_transaction()
        for i in range(start, min(records, start + TRANSACTION)):
            value = registry.encode("OrderPlaced", order_payload(i))
            headers = [("id", f"m{i}".encode()), ("event_type", b"OrderPlaced"),
                       ("aggregate_type", b"order"), ("transaction_id", str(start).encode()),
                       ("position", str(i).encode())]  # fmt: skip
            while True:
                try:
                    producer.produce(topic, value, str(i % 1000).encode(), headers=headers)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.commit_transaction(60)


def baseline(bootstrap: str, topic: str, records: int) -> float:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench",
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    seen, start = 0, time.perf_counter()
    while seen < records:
        for message in consumer.consume(10_000, 0.5):
            if message.error() is None:
                seen += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return records / elapsed


def connector_rate(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    records: int,
    checkpoint: Path,
    transform: Callable[[DataFrame], DataFrame],
) -> float:
    """Records/s of one AvailableNow query over every record of ``topic``."""
    frame = (
        spark.readStream.format("kafka")
        .options(**kafka_options(bootstrap))
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
    )
    start = time.perf_counter()
    query = (
        transform(frame)
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    read = sum(p["numInputRows"] for p in query.recentProgress)
    if read != records:
        raise RuntimeError(f"the connector read {read} records, expected {records}")
    return records / elapsed


def run(stack: Stack, scale: Scale) -> list[Figure]:
    records = scale.events * 5  # Spark pays a fixed cost per query: make it small
    topic = f"{stack.topic_prefix('spark')}.source"
    fill(stack.bootstrap, topic, records)
    spark = local_spark_session("bench-spark-connector")
    try:
        checkpoints = iter(range(10**6))
        transforms: dict[str, Callable[[DataFrame], DataFrame]] = {
            "plain": lambda frame: frame,
            "decoded": lambda frame: decode_events(frame, writer_schemas=SCHEMAS),
        }

        def query(transform: Callable[[DataFrame], DataFrame]) -> float:
            checkpoint = stack.workdir / "spark" / str(next(checkpoints))
            return connector_rate(spark, stack.bootstrap, topic, records, checkpoint, transform)

        def side(transform: Callable[[DataFrame], DataFrame]) -> Callable[[], float]:
            return lambda: query(transform)

        for transform in transforms.values():
            query(transform)  # warm-up, untimed
        rates = interleave(
            {"consumer": lambda: baseline(stack.bootstrap, topic, records),
             **{name: side(transform) for name, transform in transforms.items()}},
            scale.repetitions,
        )  # fmt: skip
    finally:
        spark.stop()
    details = {"records": records}
    return [
        Figure.of("spark", "Kafka connector rec/s (AvailableNow, noop sink)", rates["plain"],
                  "rec/s", rates["consumer"], "one confluent-kafka consumer", None, details),
        Figure.of("spark", "Kafka connector + Avro decoding rec/s", rates["decoded"], "rec/s",
                  rates["consumer"], "one confluent-kafka consumer", None, details),
    ]  # fmt: skip
