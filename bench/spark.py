"""Spark's Kafka connector (``format("kafka")``) reading and decoding the relay's records.

Records are what the relay writes (``OrderPlaced`` values of about 300 bytes, the
relay's headers), written transactionally to 3-partition topics on the embedded broker:
one topic in the ``avro`` format (single-object encoding), one in ``avro-registry`` (the
Confluent wire format, its schema registered in a local Apicurio Registry). Readers,
each reading every record once, interleaved round by round (bench/method.py):

* baseline: one plain confluent-kafka consumer (read_committed, assign), no decoding;
* the connector alone: a streaming query, Trigger.AvailableNow into Spark's ``noop``
  sink, on local[2];
* the connector with ``spark_jobs.decoding``: single-object values by Spark's
  ``from_avro`` (the jobs' default) and by the Python decoder (fastavro in an Arrow
  UDF, ``avro_decoder="fastavro"``); registry values by ``from_avro`` (the topic's
  schema known at start) and by the Python decoder keyed by schema id (a schema
  registered after the job started).

With ``OUTBOX_BENCH_BASELINE_CODE`` naming a checkout of the code before, its
``spark_jobs/decoding.py`` decodes too (``from_avro`` sides, both formats), interleaved
with the rest, so the change is measured in the same rounds.

Spark's times exclude the session start but include query planning; each side runs
once before the measured rounds, to warm the JVM and the Python workers, which a
long-running job pays once. Target (#31): read + decode >= 0.5x the plain consumer.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from pyspark.sql import DataFrame, SparkSession

from bench.harness import BASELINE_CODE, SCHEMAS, Figure, Scale, Stack, order_payload
from bench.method import Samples, interleave
from relay.adapters.registry.confluent_wire import from_single_object
from relay.adapters.registry.registry_format import registry_client
from relay.core.schemas import SchemaFolder
from relay.localstack.registry import LocalRegistry
from spark_jobs.decoding import decode_events
from spark_jobs.registry_schemas import RegistryAccess, RegistrySchema
from spark_jobs.spark_session import kafka_options, local_spark_session

PARTITIONS = 3
TRANSACTION = 10_000


def fill(bootstrap: str, topic: str, records: int, schema_id: int | None = None) -> None:
    """``records`` OrderPlaced events: single-object Avro, or with ``schema_id`` the
    Confluent wire format for that registry id."""
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
            if schema_id is not None:
                value = from_single_object(value, schema_id)
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
    """Records/s of one AvailableNow query over the whole topic (a new checkpoint)."""
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


def register(url: str, topic: str) -> RegistrySchema:
    """OrderPlaced's writer schema under the topic's subject, as the relay registers it."""
    from confluent_kafka.schema_registry import Schema

    schema = SchemaFolder.from_dir(SCHEMAS).writer_for("OrderPlaced")
    text = json.dumps(schema.parsed, separators=(",", ":"))
    schema_id = registry_client(url).register_schema(f"{topic}-value", Schema(text, "AVRO"))
    return RegistrySchema(int(schema_id), text)


def baseline_decoder(spark: SparkSession, checkout: Path, workdir: Path) -> Any:
    """``decode_events`` of another checkout (the code before), as a module of its own
    name that the Python workers import too (its UDF pickles by reference)."""
    copy = workdir / "baseline_decoding.py"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checkout / "spark_jobs" / "decoding.py", copy)
    spark.sparkContext.addPyFile(str(copy))
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module("baseline_decoding").decode_events


def run(stack: Stack, scale: Scale) -> list[Figure]:
    # Spark pays a fixed cost per query (seconds): quick (20k) only tries the method.
    records = scale.events // 5 if scale.name == "quick" else scale.events * 2
    avro_topic = f"{stack.topic_prefix('spark')}.source"
    wire_topic = f"{stack.topic_prefix('spark')}.registry"
    with LocalRegistry(stack.workdir / "registry") as registry:
        access = RegistryAccess(registry.ccompat_url)
        planned = register(access.url, wire_topic)
        fill(stack.bootstrap, avro_topic, records)
        fill(stack.bootstrap, wire_topic, records, planned.schema_id)
        spark = local_spark_session("bench-spark-connector")
        try:
            samples = _measure(spark, stack, scale, records, avro_topic, wire_topic, access,
                               planned)  # fmt: skip
        finally:
            spark.stop()
    return _figures(samples, records)


def _measure(
    spark: SparkSession,
    stack: Stack,
    scale: Scale,
    records: int,
    avro_topic: str,
    wire_topic: str,
    access: RegistryAccess,
    planned: RegistrySchema,
) -> dict[str, Samples]:
    runs = itertools.count()
    workdir = stack.workdir / "spark"

    def spark_side(topic: str, transform: Callable[[DataFrame], DataFrame]) -> Callable[[], float]:
        def measure() -> float:
            run = next(runs)
            rate = connector_rate(spark, stack.bootstrap, topic, records, workdir / f"run-{run}",
                                  transform)  # fmt: skip
            print(f"spark run {run} {topic}: {rate:.0f} rec/s", file=sys.stderr, flush=True)
            return rate

        return measure

    def decoded(
        decoder: str, fmt: str, known: list[RegistrySchema], decode: Any = decode_events
    ) -> Any:
        return lambda frame: decode(
            frame, writer_schemas=SCHEMAS, value_format=fmt, avro_decoder=decoder,
            registry=access, registry_schemas=known,
        )  # fmt: skip

    sides = {
        "consumer": lambda: baseline(stack.bootstrap, avro_topic, records),
        "connector": spark_side(avro_topic, lambda frame: frame),
        "avro_from_avro": spark_side(avro_topic, decoded("from_avro", "avro", [])),
        "avro_fastavro": spark_side(avro_topic, decoded("fastavro", "avro", [])),
        "registry_from_avro": spark_side(wire_topic, decoded("from_avro", "avro-registry", [planned])),
        "registry_by_id": spark_side(wire_topic, decoded("from_avro", "avro-registry", [])),
    }  # fmt: skip
    if os.environ.get(BASELINE_CODE):
        before = baseline_decoder(spark, Path(os.environ[BASELINE_CODE]), workdir / "baseline")
        sides["avro_from_avro_before"] = spark_side(
            avro_topic, decoded("from_avro", "avro", [], before)
        )
        sides["registry_from_avro_before"] = spark_side(
            wire_topic, decoded("from_avro", "avro-registry", [planned], before)
        )
    for measure in sides.values():  # warm-up: the JVM, the Python workers, the caches
        measure()
    return interleave(sides, scale.repetitions)


def _figures(samples: dict[str, Samples], records: int) -> list[Figure]:
    consumer, details = samples["consumer"], {"records": records}
    base = "one confluent-kafka consumer"
    named = [
        ("connector", "Kafka connector rec/s (AvailableNow, noop sink)", None),
        ("avro_from_avro", "connector + decoding, avro, from_avro (default) rec/s", "ratio>=0.5"),
        ("avro_fastavro", "connector + decoding, avro, fastavro UDF rec/s", "ratio>=0.5"),
        ("registry_from_avro", "connector + decoding, avro-registry, from_avro rec/s",
         "ratio>=0.5"),
        ("registry_by_id", "connector + decoding, avro-registry, Python decoder by id rec/s",
         "ratio>=0.5"),
    ]  # fmt: skip
    figures = [
        Figure.of("spark", name, samples[key], "rec/s", consumer, base, target, details)
        for key, name, target in named
    ]
    figures.append(
        Figure.of("spark", "single-object decoding: from_avro vs fastavro UDF",
                  samples["avro_from_avro"], "rec/s", samples["avro_fastavro"],
                  "fastavro UDF (Python, Arrow batches)", None, details)
    )  # fmt: skip
    for key, fmt in (("avro_from_avro", "avro"), ("registry_from_avro", "avro-registry")):
        if f"{key}_before" in samples:
            figures.append(
                Figure.of("spark", f"{fmt}, from_avro: this code vs the code before",
                          samples[key], "rec/s", samples[f"{key}_before"],
                          f"{key} with {BASELINE_CODE}'s decoding", None, details)
            )  # fmt: skip
    return figures
