"""Decoding the relay's records (Avro single-object encoding, headers) read by Spark's
built-in Kafka connector, on a real local Spark session and a real broker."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    name = f"spark-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(name, 3, -1)]).values():
        future.result()
    return name


def relay_records(registry: Any, count: int) -> list[Any]:
    """Records exactly as the relay encodes them (Avro single-object + headers)."""
    from datetime import UTC, datetime

    from relay.core.model import OutboxEvent
    from relay.core.subscribers import Subscriber
    from relay.engine.encoding import RecordEncoder

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
    source = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
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


def test_each_record_is_decoded_in_its_own_format_avro_or_json(
    spark: SparkSession, kafka_bootstrap: str, topic: str, registry: Any
) -> None:
    """One topic, Avro and JSON values (a subscriber switched formats): told apart by
    the single-object marker, no format named."""
    from spark_jobs.decoding import decode_events, split_corrupt

    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for record in relay_records(registry, 3):
        producer.produce(topic, record.value, record.key, headers=record.headers)
        payload = {"order_id": record.key.decode(), "note": "json"}
        producer.produce(topic, json.dumps(payload).encode(), record.key, headers=record.headers)
    producer.produce(topic, b"\xff not json", b"bad")
    producer.flush(30)
    records = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .load()
    )
    decoded = decode_events(records, writer_schemas=REPO / "schemas", keep_value=True)
    events, corrupt = split_corrupt(decoded)
    payloads = sorted(json.loads(r.payload)["order_id"] + ":" + r.payload for r in events.collect())
    assert len(payloads) == 6
    assert [p.split(":")[0] for p in payloads] == ["o-0", "o-0", "o-1", "o-1", "o-2", "o-2"]
    assert sum('"note":"json"' in p for p in payloads) == 3
    [bad] = corrupt.collect()
    assert bad.key == "bad" and bytes(bad.value) == b"\xff not json" and bad.payload is None


@pytest.mark.registry
@pytest.mark.timeout(1800)  # the registry's start and a Spark session, on 2 busy cores
def test_registry_values_decode_by_from_avro_or_by_id_and_bad_ones_are_kept(
    spark: SparkSession, kafka_bootstrap: str, topic: str, schema_registry: str, registry: Any
) -> None:
    """The Confluent wire format: the topic's latest schema (known at start) is decoded
    by from_avro, an older id of the same subject by the Python decoder; both give the
    same payloads. A body that does not decode (from_avro's row of nulls), an id the registry lacks and a job
    without a registry are error rows, with their values kept."""
    from confluent_kafka.schema_registry import Schema

    from relay.adapters.registry.confluent_wire import frame
    from spark_jobs.decoding import decode_events, split_corrupt
    from spark_jobs.registry_schemas import RegistryAccess, planned_schemas

    access = RegistryAccess(schema_registry)
    client = access.client()
    placed = registry.writer_for("OrderPlaced")
    old = {**placed.parsed, "fields": placed.parsed["fields"][:3]}  # no currency, no note
    old_id = client.register_schema(f"{topic}-value", Schema(json.dumps(old), "AVRO"))
    new_id = client.register_schema(f"{topic}-value", Schema(json.dumps(placed.parsed), "AVRO"))
    assert old_id != new_id
    from relay.core.schemas import AvroSchema, encode_with

    old_schema = AvroSchema.from_json(old)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        payload = {"order_id": f"o-{i}", "customer_id": "c", "amount_cents": i}
        headers = [("id", f"m{i}".encode()), ("position", str(i).encode())]
        body_new = encode_with(placed, {**payload, "currency": "EUR", "note": None})[10:]
        body_old = encode_with(old_schema, payload)[10:]
        producer.produce(topic, frame(new_id, body_new), b"new", headers=headers)
        producer.produce(topic, frame(old_id, body_old), b"old", headers=headers)
    producer.produce(topic, frame(new_id, b"\xff\xff\xff"), b"bad-body")
    producer.produce(topic, frame(2**31 - 7, body_new), b"no-such-id")
    producer.flush(30)

    records = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .load()
    )
    planned = planned_schemas(access, "avro-registry", topic)
    assert [s.schema_id for s in planned] == [new_id]  # the latest: from_avro's
    decoded = decode_events(
        records, writer_schemas=REPO / "schemas", value_format="avro-registry",
        keep_value=True, registry=access, registry_schemas=planned,
    )  # fmt: skip
    events, corrupt = split_corrupt(decoded)
    rows = sorted(events.collect(), key=lambda r: (r.key, r.position))
    assert [(r.key, r.message_id, r.position) for r in rows] == [
        (k, f"m{i}", i) for k in ("new", "old") for i in range(3)
    ]
    assert json.loads(rows[0].payload) == {"order_id": "o-0", "customer_id": "c",
                                           "amount_cents": 0, "currency": "EUR", "note": None}  # fmt: skip
    assert json.loads(rows[3].payload) == {"order_id": "o-0", "customer_id": "c", "amount_cents": 0}
    bad = {r.key: r for r in corrupt.collect()}
    assert sorted(bad) == ["bad-body", "no-such-id"]
    assert bad["bad-body"].error  # from_avro's null row, told by the Python decoder
    assert "not in the registry" in bad["no-such-id"].error
    assert all(r.payload is None and bytes(r.value)[:1] == b"\x00" for r in bad.values())

    # A job told of no registry: every registry value is kept, with the reason.
    blind = decode_events(records, writer_schemas=REPO / "schemas", value_format="auto")
    reasons = {r.error.split(":")[0] for r in blind.collect()}
    assert reasons == {"SchemaError"}
    assert "knows no registry" in blind.first().error


def test_a_registry_that_cannot_be_reached_fails_the_batch_rather_than_the_records() -> None:
    """The records are fine: marking them undecodable would archive them as errors for
    good. The Python decoder raises instead (the query fails; a restart reads them)."""
    from relay.adapters.registry.confluent_wire import frame
    from relay.errors import SchemaRegistryUnavailable
    from relay.localstack.process import free_port
    from spark_jobs import decoding
    from spark_jobs.registry_schemas import RegistryAccess

    down = RegistryAccess(f"http://spark:s3cret-pw@127.0.0.1:{free_port()}")
    with pytest.raises(SchemaRegistryUnavailable) as failed:
        decoding._payload(frame(7, b"\x02"), "auto", str(REPO / "schemas"), None, down)
    assert "s3cret-pw" not in str(failed.value)


def test_headers_are_the_last_of_their_name_and_numbers_only_when_they_are(
    spark: SparkSession, registry: Any
) -> None:
    """A header the relay sends twice is read as its last value; a missing one, or a
    number header that is not a number, is a null, never a failed query."""
    from datetime import UTC, datetime

    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    from spark_jobs.decoding import decode_events

    header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    source = StructType(
        [StructField("topic", StringType()), StructField("partition", IntegerType()),
         StructField("offset", LongType()), StructField("timestamp", TimestampType()),
         StructField("key", BinaryType()), StructField("value", BinaryType()),
         StructField("headers", ArrayType(header))]
    )  # fmt: skip
    [record] = relay_records(registry, 1)
    now = datetime.now(UTC)
    rows = [
        ("t", 0, 0, now, b"twice", record.value,
         [("id", b"first"), ("position", b"1"), ("id", b"last"), ("position", b"2")]),
        ("t", 0, 1, now, b"odd", record.value,
         [("position", b"12x"), ("transaction_id", b"99999999999999999999")]),
        ("t", 0, 2, now, b"none", record.value, []),
        ("t", 0, 3, now, b"null", record.value, None),
    ]  # fmt: skip
    decoded = decode_events(spark.createDataFrame(rows, source), writer_schemas=REPO / "schemas")
    got = {r.key: r for r in decoded.collect()}
    assert (got["twice"].message_id, got["twice"].position) == ("last", 2)
    assert (got["odd"].position, got["odd"].transaction_id, got["odd"].message_id) == (None,) * 3
    for key in ("none", "null"):
        assert (got[key].message_id, got[key].position, got[key].event_type) == (None,) * 3
    assert all(r.error is None and r.payload for r in got.values())
