"""The throughput of Spark's Kafka connector (``format("kafka")``).

Baseline: one plain confluent-kafka consumer (read_committed, assign) reading every
partition of the topic. Source: a streaming query over ``format("kafka")``
with Trigger.AvailableNow into Spark's ``noop`` sink, on local[2]; its time excludes
the session start but includes query planning. Records are 300 bytes, written
transactionally to a 3-partition topic on the embedded broker.
"""

from __future__ import annotations

import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.harness import Figure, Scale, Stack
from spark_jobs.session import kafka_options, local_session

PARTITIONS = 3


def fill(bootstrap: str, topic: str, records: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, -1)]).values():
        future.result()
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"bench-{topic}", "linger.ms": 20}
    )
    producer.init_transactions(30)
    value = b"x" * 300
    for start in range(0, records, 10_000):
        producer.begin_transaction()
        for i in range(start, min(records, start + 10_000)):
            while True:
                try:
                    producer.produce(topic, value, str(i % 1000).encode())
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


def source(bootstrap: str, topic: str, records: int, workdir: Path) -> float:
    """Records/s of the second of two identical queries: the first warms the JVM and
    the Python workers, which a long-running job pays once."""
    spark = local_session("bench-spark-source")
    try:
        rates = []
        for run in ("warm-up", "measured"):
            frame = (
                spark.readStream.format("kafka")
                .options(**kafka_options(bootstrap))
                .option("subscribe", topic)
                .option("startingOffsets", "earliest")
                .load()
            )
            start = time.perf_counter()
            query = (
                frame.writeStream.format("noop")
                .option("checkpointLocation", str(workdir / run))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()
            elapsed = time.perf_counter() - start
            read = sum(p["numInputRows"] for p in query.recentProgress)
            if read != records:
                raise RuntimeError(f"the source read {read} records, expected {records}")
            rates.append(records / elapsed)
        return rates[-1]
    finally:
        spark.stop()


def run(stack: Stack, scale: Scale) -> list[Figure]:
    records = scale.events * 5  # Spark pays a fixed cost per query: make it small
    topic = f"{stack.topic_prefix('spark')}.source"
    fill(stack.bootstrap, topic, records)
    base = baseline(stack.bootstrap, topic, records)
    ours = source(stack.bootstrap, topic, records, stack.workdir / "spark")
    return [
        Figure("spark", "Kafka source rec/s (AvailableNow, noop sink)", ours, "rec/s", base,
               "one confluent-kafka consumer", None, {"records": records}),
    ]  # fmt: skip
