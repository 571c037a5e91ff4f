"""The stock Confluent Python client against a real schema registry (the
``schema_registry`` fixture: Apicurio Registry's Confluent-compatible API): what the
schema-registry value format (issue #32) relies on, checked without any HTTP mock."""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from relay.adapters.registry.confluent_wire import from_single_object
from relay.core.schemas import AvroSchema, encode_with

# The first use builds Apicurio Registry with Maven (minutes, once per machine): the
# session fixture's setup counts against the first test's timeout.
pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

ORDER_V1: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "outbox.test",
    "fields": [{"name": "id", "type": "long"}, {"name": "amount", "type": "double"}],
}
# Backward compatible: a new field with a default (readers of v2 can read v1 data).
ORDER_V2 = {
    **ORDER_V1,
    "fields": [*ORDER_V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}],
}
# Incompatible: a long becomes a string.
ORDER_BAD = {**ORDER_V1, "fields": [{"name": "id", "type": "string"}, ORDER_V1["fields"][1]]}


def avro(schema: dict[str, Any]) -> Schema:
    return Schema(json.dumps(schema), "AVRO")


@pytest.fixture
def client(schema_registry: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


@pytest.fixture
def subject(topic_prefix: str) -> str:
    return f"{topic_prefix}orders-value"


def test_registers_a_schema_and_reads_it_back_by_id(
    client: SchemaRegistryClient, subject: str
) -> None:
    schema_id = client.register_schema(subject, avro(ORDER_V1))

    fetched = client.get_schema(schema_id)
    assert json.loads(fetched.schema_str) == ORDER_V1
    assert fetched.schema_type == "AVRO"
    latest = client.get_latest_version(subject)
    assert (latest.schema_id, latest.version) == (schema_id, 1)
    # Registering the same schema again is idempotent: same id, no new version.
    assert client.register_schema(subject, avro(ORDER_V1)) == schema_id
    assert client.get_versions(subject) == [1]


def test_a_compatible_evolution_is_accepted_and_an_incompatible_one_refused(
    client: SchemaRegistryClient, subject: str
) -> None:
    client.register_schema(subject, avro(ORDER_V1))
    client.set_compatibility(subject, "BACKWARD")

    assert client.test_compatibility(subject, avro(ORDER_V2)) is True
    assert client.test_compatibility(subject, avro(ORDER_BAD)) is False
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema(subject, avro(ORDER_BAD))
    assert refused.value.http_status_code == 409
    # The reason names what broke: the type of field "id" (the first field).
    assert "/fields/0/type" in refused.value.error_message
    assert "STRING" in refused.value.error_message

    v2_id = client.register_schema(subject, avro(ORDER_V2))
    assert client.get_versions(subject) == [1, 2]
    assert client.get_latest_version(subject).schema_id == v2_id


def test_avro_serializer_and_deserializer_round_trip_a_record(
    client: SchemaRegistryClient, subject: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}orders"
    context = SerializationContext(topic, MessageField.VALUE)
    serialize = AvroSerializer(client, json.dumps(ORDER_V1))
    record = {"id": 42, "amount": 9.5}

    payload = serialize(record, context)

    assert payload is not None
    # Confluent wire format: magic byte 0, the schema id (4 bytes, big-endian), Avro body.
    schema_id = client.get_latest_version(subject).schema_id
    assert payload[0] == 0
    assert int.from_bytes(payload[1:5], "big") == schema_id
    assert AvroDeserializer(client)(payload, context) == record
    # A reader on the evolved schema resolves the old record, filling the default.
    assert AvroDeserializer(client, json.dumps(ORDER_V2))(payload, context) == {
        **record,
        "note": None,
    }


def test_the_relays_avro_body_reframed_is_read_by_the_stock_deserializer(
    client: SchemaRegistryClient, subject: str, topic_prefix: str
) -> None:
    """The groundwork of the schema-registry format: the Avro body the relay's ``avro``
    format writes, framed with the id the registry gave its schema, is what a Confluent
    consumer reads."""
    schema = AvroSchema.from_json(ORDER_V1)
    record = {"id": 7, "amount": 1.25}
    schema_id = client.register_schema(subject, avro(ORDER_V1))

    value = from_single_object(encode_with(schema, record), schema_id)

    context = SerializationContext(f"{topic_prefix}orders", MessageField.VALUE)
    assert AvroDeserializer(client)(value, context) == record
