"""`outbox-relay topics tail` as a user runs it, on Apache Kafka and a schema registry:
each value format the relay writes decoded, headers shown, an aborted transaction's
record never (read_committed)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from relay.adapters.registry.registry_format import RegistryValueEncoder, registry_client
from relay.core.schemas import SchemaFolder
from tests.support import REPO, run_cli

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

DEMO = REPO / "schemas" / "demo"
ORDER = {"order_id": "42", "customer_id": "c-7", "amount_cents": 1250}
READ = {**ORDER, "currency": "EUR", "note": None}  # as read back: the defaults filled in


def produce(bootstrap: str, topic: str, values: list[bytes], aborted: bytes) -> None:
    """``values`` committed on ``topic`` (keys k0, k1, ...), after a transaction that
    wrote ``aborted`` and aborted."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": uuid.uuid4().hex})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, aborted, b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    for n, value in enumerate(values):
        producer.produce(topic, value, f"k{n}".encode(), headers=[("event_type", b"OrderPlaced")])
    producer.commit_transaction(30)


def test_tail_decodes_every_format_the_relay_writes(
    kafka_bootstrap: str, schema_registry: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}tail"
    schemas = SchemaFolder.from_dir(DEMO)
    wire = RegistryValueEncoder(schemas, registry_client(schema_registry))
    values = [
        json.dumps(ORDER).encode(),
        schemas.encode("OrderPlaced", ORDER),
        wire.encode(topic, "OrderPlaced", ORDER),
    ]
    produce(kafka_bootstrap, topic, values, json.dumps({"aborted": True}).encode())
    done = run_cli(
        "topics", "tail", topic, "--from-beginning", "--max", "3", "--timeout", "60", "--json",
        "--schemas-dir", str(DEMO), "--schema-registry-url", schema_registry,
        env={"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["key"]["content"] for r in shown] == ["k0", "k1", "k2"]  # not the aborted
    assert [(r["value"]["encoding"], r["value"]["content"]) for r in shown] == [
        ("json", ORDER),
        ("avro", READ),
        ("avro-registry", READ),
    ]
    assert shown[1]["value"]["schema"] == "demo.orders.OrderPlaced"
    assert all(r["headers"] == [["event_type", "OrderPlaced"]] for r in shown)


def test_tail_shows_undecodable_values_as_bytes_saying_what_it_lacks(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Without the writer schema or the registry, Avro values are bytes with the
    reason, in the plain output a person reads; the command still ends well."""
    topic = f"{topic_prefix}tail-bytes"
    avro = SchemaFolder.from_dir(DEMO).encode("OrderPlaced", ORDER)
    produce(kafka_bootstrap, topic, [avro, b"\x00\x00\x00\x00\x07body"], b"x")
    done = run_cli(
        "topics", "tail", topic, "--from-beginning", "--max", "2", "--timeout", "60",
        "--schemas-dir", str(tmp_path),  # no .avsc there
        env={"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert f"{topic}[" in printed and "header event_type: OrderPlaced" in printed
    assert "(bytes (Avro single-object (fingerprint " in printed
    assert "unknown writer schema fingerprint" in printed
    assert "(schema id 7): give --schema-registry-url)) AAAAAAdib2R5" in printed
