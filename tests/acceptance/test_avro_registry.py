"""Issue #32: the avro-registry value format end to end. A relay publishes demo events in
the Confluent wire format with ids from a real schema registry (Apicurio), and the stock
``AvroDeserializer`` reads each one, exactly once; a registry that cannot be reached
stalls publication (no poison, no dead letter) until it can."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from relay.errors import SchemaIncompatible
from relay.localstack.process import free_port
from tests.support import (
    REPO,
    caught_up,
    consume,
    fenced_blocks,
    http_get,
    order,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
    worker,
    write_orders,
)

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

StartRelay = Callable[..., Relay]
IDS = [f"r{i}" for i in range(20)]


def _read_all(registry_url: str, bootstrap: str, topic: str, expected: int) -> list[Any]:
    """Every record of ``topic`` (read_committed), decoded by the stock deserializer."""
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    context = SerializationContext(topic, MessageField.VALUE)
    return [deserialize(r.value, context) for r in consume(bootstrap, [topic], expected)]


def test_the_stock_avro_deserializer_reads_every_event_exactly_once(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
) -> None:
    write_orders(writer_db, outbox, IDS[:10])
    start_relay(
        schema_registry_url=schema_registry,
        subscribers=[sub("reg", topic_prefix, value_format="avro-registry")],
    )
    write_orders(writer_db, outbox, IDS[10:])
    wait_caught_up(db, "reg", timeout=120)

    topic = topic_prefix + "outbox.event.order"
    values = _read_all(schema_registry, kafka_bootstrap, topic, len(IDS))
    assert sorted(v["order_id"] for v in values) == sorted(IDS)  # each once
    for value in values:
        assert order(value["order_id"]).items() <= value.items()
    # Registered under TopicNameStrategy's subject, as stock serializers would.
    subjects = SchemaRegistryClient({"url": schema_registry}).get_subjects()
    assert f"{topic}-value" in subjects


def test_an_unreachable_registry_stalls_without_poison_and_publication_resumes(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    definition = [sub("down", topic_prefix, value_format="avro-registry", on_poison="dead-letter")]
    write_orders(writer_db, outbox, IDS)
    dead_port = f"http://127.0.0.1:{free_port()}"
    stalled = start_relay(schema_registry_url=dead_port, subscribers=definition)

    part = worker(stalled, "down")
    wait_until(lambda: part.stats.state is WorkerState.RETRYING, 60, "the part to retry")
    wait_until(lambda: part.stats.errors >= 3, 120, "a third attempt")
    assert not caught_up(db, "down")
    assert part.stats.poisoned == 0 and part.stats.dead_lettered == 0
    assert OutboxStore(db).get_part("down", 0).halted_error is None
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)
    # Visibly: /readyz names the part (still ready, as for a leaderless partition:
    # every replica would wait alike), /metrics shows it, and one warning says why.
    assert stalled.http is not None
    base = f"http://127.0.0.1:{stalled.http.port}"
    status, ready = http_get(base + "/readyz")
    assert status == 200, ready
    assert "waiting for the schema registry (unreachable since" in ready
    assert ready.rstrip().endswith(": down/0")
    status, metrics = http_get(base + "/metrics")
    waiting = 'outbox_relay_part_waiting{part="0",service="schema_registry",subscriber="down"} 1.0'
    assert status == 200 and waiting in metrics.splitlines()
    said = [r for r in caplog.records if getattr(r, "event", None) == "registry.unreachable"]
    assert [r.levelno for r in said] == [logging.WARNING]  # once, not once per retry
    stalled.stop()

    # The registry back (here: the relay told where it is): every event, once.
    start_relay(schema_registry_url=schema_registry, subscribers=definition)
    wait_caught_up(db, "down", timeout=120)
    topic = topic_prefix + "outbox.event.order"
    values = _read_all(schema_registry, kafka_bootstrap, topic, len(IDS))
    assert sorted(v["order_id"] for v in values) == sorted(IDS)


# -- compatibility, before anything is published ------------------------------------

REPO_ORDER = json.loads((REPO / "schemas" / "demo" / "OrderPlaced.avsc").read_text())
# An older OrderPlaced whose amount was text: the repo's (a long) cannot read it.
TEXT_AMOUNT = {
    **REPO_ORDER,
    "fields": [
        {**f, "type": "string"} if f["name"] == "amount_cents" else f for f in REPO_ORDER["fields"]
    ],
}


def _register_backward(registry_url: str, subject: str, document: dict[str, Any]) -> None:
    client = SchemaRegistryClient({"url": registry_url})
    client.register_schema(subject, Schema(json.dumps(document), "AVRO"))
    client.set_compatibility(subject, "BACKWARD")


def test_subscribers_add_refuses_schemas_the_registry_rules_out(
    db: psycopg.Connection[Any],
    database_url: str,
    topic_prefix: str,
    schema_registry: str,
    tmp_path: Path,
) -> None:
    topic = f"{topic_prefix}orders"
    _register_backward(schema_registry, f"{topic}-value", REPO_ORDER)
    (tmp_path / "OrderPlaced.avsc").write_text(json.dumps(TEXT_AMOUNT))
    add = [
        "subscribers", "add", "reg", "--format", "avro-registry", "--topic", topic,
        "--schema-registry-url", schema_registry, "--database-url", database_url,
    ]  # fmt: skip

    refused = run_cli(*add, "--schemas-dir", str(tmp_path))

    assert refused.returncode == 2, refused.stderr
    message = " ".join(refused.stderr.split())
    assert f"subject '{topic}-value' (compatibility BACKWARD, versions [1])" in message
    assert "refuses demo.orders.OrderPlaced" in message and "OrderPlaced.avsc" in message
    assert "fields/2/type" in message  # the registry's reason names the field
    assert OutboxStore(db).list() == []  # nothing added
    # The repo's own schema is that version: added, and the check says so.
    added = run_cli(*add, "--schemas-dir", str(REPO / "schemas"))
    assert added.returncode == 0, added.stderr
    assert f"{topic}-value: demo.orders.OrderPlaced" in added.stdout
    assert "is compatible with versions [1] (BACKWARD)" in added.stdout


def test_the_relay_refuses_to_start_with_schemas_the_registry_rules_out(
    topic_prefix: str, start_relay: StartRelay, schema_registry: str
) -> None:
    """Refused at start-up, not halted: the relays still running in a rolling deploy keep
    publishing with the schemas the registry accepts (a halt would stop them too)."""
    topic = f"{topic_prefix}orders"
    _register_backward(schema_registry, f"{topic}-value", TEXT_AMOUNT)
    definition = [{"name": "reg", "topic": topic, "value_format": "avro-registry"}]

    with pytest.raises(SchemaIncompatible) as refused:
        start_relay(schema_registry_url=schema_registry, subscribers=definition)
    message = str(refused.value)
    assert f"subject '{topic}-value' (compatibility BACKWARD, versions [1])" in message
    assert "subscriber 'reg' is not created" in message


# -- keys in the wire format --------------------------------------------------------


def test_avro_registry_keys_are_read_by_the_stock_deserializer(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
) -> None:
    definition = sub("keys", topic_prefix, value_format="avro-registry", key_format="avro-registry")
    start_relay(schema_registry_url=schema_registry, subscribers=[definition])
    write_orders(writer_db, outbox, IDS[:5])
    wait_caught_up(db, "keys", timeout=120)

    topic = topic_prefix + "outbox.event.order"
    client = SchemaRegistryClient({"url": schema_registry})
    keys = AvroDeserializer(client)
    values = AvroDeserializer(client)
    context = SerializationContext(topic, MessageField.KEY)
    read = [
        (keys(r.key, context), values(r.value, SerializationContext(topic, MessageField.VALUE)))
        for r in consume(kafka_bootstrap, [topic], 5)
    ]
    assert sorted(read, key=lambda kv: kv[0]) == sorted(
        [(i, {**order(i), "currency": "EUR", "note": None}) for i in IDS[:5]]
    )
    assert client.get_latest_version(f"{topic}-key").schema.schema_str.strip('" ') == "string"


# -- the README's consumer -----------------------------------------------------------


def _readme_consumer() -> str:
    """The README's Python block that reads the registry format (on its configuration
    page)."""
    blocks = fenced_blocks(REPO / "docs" / "configuration.md", "python")
    [block] = [b for b in blocks if "AvroDeserializer" in b]
    return block


def test_the_readmes_registry_consumer_reads_what_the_relay_publishes(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
) -> None:
    """The block runs as written: only the registry's URL, the bootstrap servers and the
    topic (the README's orders.{aggregate_type}, prefixed) are this test's own."""
    definition = {"name": "orders", "topic": topic_prefix + "orders.{aggregate_type}"}
    start_relay(
        schema_registry_url=schema_registry,
        subscribers=[{**definition, "value_format": "avro-registry"}],
    )
    write_orders(writer_db, outbox, IDS[:5])
    wait_caught_up(db, "orders", timeout=120)

    code = _readme_consumer()
    for written, here in (
        ("https://registry:8081", schema_registry),
        ("kafka:9092", kafka_bootstrap),
        ('"orders.order"', f'"{topic_prefix}orders.order"'),
    ):
        assert written in code
        code = code.replace(written, here)
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert ran.returncode == 0, ran.stderr
    printed = ran.stdout.splitlines()
    assert len(printed) == 5
    for i in IDS[:5]:
        assert any(line.startswith(f"b'{i}' {{'order_id': '{i}'") for line in printed), printed
