"""The compatibility check of an avro-registry subscriber's local schemas
(relay/adapters/registry/registry_compat.py) against a real schema registry's rules: a schema that breaks
a BACKWARD subject is refused with the subject, its level, its versions and the
registry's reason; an evolution, an already registered schema and a new subject pass;
nothing is registered by checking."""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from relay.adapters.registry.registry_compat import check_subscriber, schema_text
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.core.subscribers import KeyFormat, SubjectStrategy, Subscriber, ValueFormat
from relay.errors import SchemaIncompatible, SchemaRegistryUnavailable
from relay.localstack import free_port

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

ID = {"name": "id", "type": "long"}
NOTE = {"name": "note", "type": ["null", "string"], "default": None}


def record(name: str, *fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": name, "namespace": "shop", "fields": list(fields)}


def folder(*documents: dict[str, Any]) -> SchemaFolder:
    return SchemaFolder([AvroSchema.from_json(d) for d in documents])


def subscriber(topic: str, **fields: Any) -> Subscriber:
    return Subscriber("s", topic=topic, value_format=ValueFormat.AVRO_REGISTRY, **fields)


@pytest.fixture
def client(schema_registry: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


@pytest.fixture
def topic(client: SchemaRegistryClient, topic_prefix: str) -> str:
    """A topic whose subject holds v1 of shop.Order under BACKWARD compatibility, as a
    relay registered it."""
    topic = f"{topic_prefix}orders"
    v1 = schema_text(AvroSchema.from_json(record("Order", ID)))
    client.register_schema(f"{topic}-value", Schema(v1, "AVRO"))
    client.set_compatibility(f"{topic}-value", "BACKWARD")
    return topic


def test_a_schema_that_breaks_the_subject_is_refused_with_the_registrys_reason(
    client: SchemaRegistryClient, topic: str
) -> None:
    breaking = folder(record("Order", {"name": "id", "type": "string"}))

    with pytest.raises(SchemaIncompatible) as refused:
        check_subscriber(client, breaking, subscriber(topic))

    message = str(refused.value)
    assert f"subject '{topic}-value' (compatibility BACKWARD, versions [1])" in message
    assert "refuses shop.Order" in message and "fingerprint" in message
    assert "fields/0/type" in message  # the registry's own reason
    assert client.get_versions(f"{topic}-value") == [1]  # checking registered nothing


def test_an_evolution_and_a_registered_schema_pass_and_say_so(
    client: SchemaRegistryClient, topic: str
) -> None:
    evolved = check_subscriber(client, folder(record("Order", ID, NOTE)), subscriber(topic))
    same = check_subscriber(client, folder(record("Order", ID)), subscriber(topic))

    assert evolved.checked == [
        f"{topic}-value: shop.Order (schema, fingerprint "
        f"{AvroSchema.from_json(record('Order', ID, NOTE)).fingerprint.hex()}) is compatible "
        "with versions [1] (BACKWARD)"
    ]
    assert same.checked[0].endswith(
        f"is version 1 (id {client.get_latest_version(f'{topic}-value').schema_id})"
    )
    assert client.get_versions(f"{topic}-value") == [1]


def test_other_records_of_the_folder_are_not_checked_against_a_topic_subject(
    client: SchemaRegistryClient, topic: str
) -> None:
    """No event-type filter: the folder's Customer may never reach the orders topic."""
    schemas = folder(
        record("Order", ID, NOTE), record("Customer", {"name": "name", "type": "string"})
    )

    report = check_subscriber(client, schemas, subscriber(topic))
    assert [line.split(" (")[0] for line in report.checked] == [f"{topic}-value: shop.Order"]

    # Named by the filter, it is checked, and the subject refuses it.
    with pytest.raises(SchemaIncompatible, match=r"refuses shop\.Customer"):
        check_subscriber(client, schemas, subscriber(topic, event_types=frozenset({"Customer"})))


def test_record_subjects_are_checked_and_per_row_topics_are_reported_unchecked(
    client: SchemaRegistryClient, topic_prefix: str
) -> None:
    namespace = topic_prefix.rstrip(".")  # a subject of its own: the registry is shared
    client.register_schema(
        f"{namespace}.Order",
        Schema(json.dumps(record("Order", ID) | {"namespace": namespace}), "AVRO"),
    )
    client.set_compatibility(f"{namespace}.Order", "BACKWARD")
    breaking = folder(record("Order", {"name": "id", "type": "string"}) | {"namespace": namespace})
    per_row = f"{topic_prefix}{{aggregate_type}}"

    with pytest.raises(SchemaIncompatible, match=f"subject '{namespace}.Order'"):
        check_subscriber(
            client, breaking, subscriber(per_row, subject_strategy=SubjectStrategy.RECORD)
        )
    report = check_subscriber(client, breaking, subscriber(per_row))
    assert report.checked == [] and len(report.unchecked) == 1


def test_an_event_type_of_the_filter_without_a_schema_is_refused(
    client: SchemaRegistryClient, topic: str
) -> None:
    with pytest.raises(SchemaIncompatible, match=r"'Refund' .* has no writer schema"):
        check_subscriber(
            client,
            folder(record("Order", ID)),
            subscriber(topic, event_types=frozenset({"Refund"})),
        )


def test_an_unreachable_registry_is_unavailable_not_a_refusal(topic_prefix: str) -> None:
    nowhere = SchemaRegistryClient({"url": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(SchemaRegistryUnavailable):
        check_subscriber(nowhere, folder(record("Order", ID)), subscriber(f"{topic_prefix}o"))


def test_an_avro_registry_key_is_checked_under_the_topics_key_subject(
    client: SchemaRegistryClient, topic: str
) -> None:
    client.register_schema(f"{topic}-key", Schema('"long"', "AVRO"))  # another producer's keys
    client.set_compatibility(f"{topic}-key", "BACKWARD")
    keyed = subscriber(topic, key_format=KeyFormat.AVRO_REGISTRY)

    with pytest.raises(SchemaIncompatible, match=rf"subject '{topic}-key' .* refuses the key"):
        check_subscriber(client, folder(record("Order", ID)), keyed)
    # Text keys are not the registry's business.
    check_subscriber(client, folder(record("Order", ID)), subscriber(topic))
