"""The avro-registry value encoder (relay/adapters/registry/registry_format.py) against a real schema
registry: values the stock Confluent deserializer reads, ids cached, an incompatible
schema refused with the registry's reason (a configuration error, never poison), an
unreachable registry retryable."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from relay.adapters.registry.registry_format import (
    RegistryValueEncoder,
    SchemaIncompatible,
    registry_client,
)
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.errors import EncodingError, RetryableError
from relay.localstack import free_port

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]


def order(*fields: dict[str, Any]) -> AvroSchema:
    return AvroSchema.from_json(
        {"type": "record", "name": "Order", "namespace": "shop", "fields": list(fields)}
    )


ID = {"name": "id", "type": "long"}
NOTE = {"name": "note", "type": ["null", "string"], "default": None}


class CountingClient(SchemaRegistryClient):
    registrations = 0

    def register_schema(self, *args: Any, **kwargs: Any) -> int:
        self.registrations += 1
        return int(super().register_schema(*args, **kwargs))


@pytest.fixture
def client(schema_registry: str) -> CountingClient:
    return CountingClient({"url": schema_registry})


def read(client: SchemaRegistryClient, topic: str, value: bytes) -> Any:
    return AvroDeserializer(client)(value, SerializationContext(topic, MessageField.VALUE))


def test_values_are_read_by_the_stock_deserializer_and_ids_are_cached(
    client: CountingClient, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}orders"
    encoder = RegistryValueEncoder(SchemaFolder([order(ID, NOTE)]), client)

    first = encoder.encode(topic, "shop.Order", {"id": 1, "note": "a"})
    second = encoder.encode(topic, "Order", {"id": 2, "note": None})

    assert read(client, topic, first) == {"id": 1, "note": "a"}
    assert read(client, topic, second) == {"id": 2, "note": None}
    assert client.registrations == 1  # once per (subject, schema), not per event
    latest = client.get_latest_version(f"{topic}-value")
    assert int.from_bytes(first[1:5], "big") == latest.schema_id
    assert first[0] == 0


def test_an_evolved_schema_gets_a_new_id_and_an_incompatible_one_is_refused(
    client: CountingClient, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}orders"
    v1 = RegistryValueEncoder(SchemaFolder([order(ID)]), client).encode(topic, "Order", {"id": 1})
    client.set_compatibility(f"{topic}-value", "BACKWARD")

    v2 = RegistryValueEncoder(SchemaFolder([order(ID, NOTE)]), client).encode(
        topic, "Order", {"id": 2, "note": "b"}
    )
    bad = RegistryValueEncoder(SchemaFolder([order({"name": "id", "type": "string"})]), client)

    assert v1[1:5] != v2[1:5]
    assert read(client, topic, v2) == {"id": 2, "note": "b"}
    # The relay's configuration (its schemas vs the subject's rules), not the event's fault.
    with pytest.raises(SchemaIncompatible, match=r"refused shop\.Order .*fields/0/type"):
        bad.encode(topic, "Order", {"id": "x"})


def test_an_unreachable_registry_is_retryable_not_a_poison_event(topic_prefix: str) -> None:
    nowhere = SchemaRegistryClient({"url": f"http://127.0.0.1:{free_port()}"})
    encoder = RegistryValueEncoder(SchemaFolder([order(ID)]), nowhere)

    with pytest.raises(RetryableError) as raised:
        encoder.encode(f"{topic_prefix}orders", "Order", {"id": 1})
    assert not isinstance(raised.value, EncodingError)


def test_a_consumer_of_the_old_schema_keeps_reading_after_a_new_optional_field(
    client: CountingClient, topic_prefix: str
) -> None:
    """v1 (id, amount) is published; then the relay's schemas gain an optional note (v2):
    published under a new id, and a stock deserializer given v1 as its reader schema
    reads both, v2's values without the note (Avro schema resolution)."""
    topic = f"{topic_prefix}orders"
    amount = {"name": "amount", "type": "double"}
    client.set_compatibility(f"{topic}-value", "BACKWARD")
    old = RegistryValueEncoder(SchemaFolder([order(ID, amount)]), client)
    new = RegistryValueEncoder(SchemaFolder([order(ID, amount, NOTE)]), client)

    v1 = old.encode(topic, "Order", {"id": 1, "amount": 1.5})
    v2 = new.encode(topic, "Order", {"id": 2, "amount": 2.5, "note": "gift"})

    assert v1[1:5] != v2[1:5]  # a new id
    assert client.get_versions(f"{topic}-value") == [1, 2]
    v1_reader = Schema(json.dumps(order(ID, amount).parsed), "AVRO")
    old_consumer = AvroDeserializer(client, schema_str=v1_reader)
    context = SerializationContext(topic, MessageField.VALUE)
    assert old_consumer(v1, context) == {"id": 1, "amount": 1.5}
    assert old_consumer(v2, context) == {"id": 2, "amount": 2.5}
    # And a consumer already on v2 reads v1's values with the note's default.
    assert read(client, topic, v1) == {"id": 1, "amount": 1.5}
    v2_reader = Schema(json.dumps(order(ID, amount, NOTE).parsed), "AVRO")
    new_consumer = AvroDeserializer(client, schema_str=v2_reader)
    assert new_consumer(v1, context) == {"id": 1, "amount": 1.5, "note": None}


def test_a_registry_that_never_answers_is_retryable_not_a_hang(topic_prefix: str) -> None:
    """A listener that accepts connections and never answers (the client's default is no
    timeout: the part would wait forever, showing nothing)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        encoder = RegistryValueEncoder(SchemaFolder([order(ID)]), registry_client(url, timeout=0.5))
        with pytest.raises(RetryableError, match="unreachable"):
            encoder.encode(f"{topic_prefix}orders", "Order", {"id": 1})
