"""The Spark Kafka source's throughput, as a ratio against a same-run baseline.

    .venv/bin/python bench/spark_source_throughput.py [--records 500000]

Baseline: one plain confluent-kafka consumer (read_committed, assign) reading every
partition of the topic. Source: a streaming query over ``spark_jobs.kafka_source``
with Trigger.AvailableNow into Spark's ``noop`` sink, on local[2]; its time excludes
the session start but includes query planning. Records are 300 bytes, written
transactionally to a 3-partition topic on the embedded broker. Prints a table and
writes bench/results/spark_source_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.embedded import LocalBroker
from spark_jobs.session import local_session, read_kafka

REPO = Path(__file__).resolve().parent.parent
TOPIC = "bench-spark-source"
PARTITIONS = 3


def fill(bootstrap: str, records: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(TOPIC, PARTITIONS, -1)]).values():
        future.result()
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": "bench", "linger.ms": 20}
    )
    producer.init_transactions(30)
    value = b"x" * 300
    for start in range(0, records, 10_000):
        producer.begin_transaction()
        for i in range(start, min(records, start + 10_000)):
            while True:
                try:
                    producer.produce(TOPIC, value, str(i % 1000).encode())
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.commit_transaction(60)


def baseline(bootstrap: str, records: int) -> float:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench",
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50,
        }
    )
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(PARTITIONS)])
    seen, start = 0, time.perf_counter()
    while seen < records:
        for message in consumer.consume(10_000, 0.5):
            if message.error() is None:
                seen += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return records / elapsed


def source(bootstrap: str, records: int, workdir: Path) -> float:
    """Records/s of the second of two identical queries: the first warms the JVM and
    the Python workers, which a long-running job pays once."""
    spark = local_session("bench-spark-source")
    try:
        rates = []
        for run in ("warm-up", "measured"):
            frame = read_kafka(
                spark,
                subscribe=TOPIC,
                startingOffsets="earliest",
                **{"kafka.bootstrap.servers": bootstrap},
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
                raise SystemExit(f"the source read {read} records, expected {records}")
            rates.append(records / elapsed)
        return rates[-1]
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=500_000)
    args = parser.parse_args()
    import tempfile

    with LocalBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        fill(broker.bootstrap_servers, args.records)
        base = baseline(broker.bootstrap_servers, args.records)
        ours = source(broker.bootstrap_servers, args.records, Path(tmp))
    result = {
        "records": args.records,
        "baseline_records_per_s": round(base),
        "source_records_per_s": round(ours),
        "ratio": round(ours / base, 2),
    }
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "spark_source_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'records':>10} {'baseline rec/s':>15} {'source rec/s':>13} {'ratio':>6}")
    print(
        f"{args.records:>10} {result['baseline_records_per_s']:>15,} "
        f"{result['source_records_per_s']:>13,} {result['ratio']:>6}"
    )


if __name__ == "__main__":
    main()
