"""The debezium format under Apicurio's AvroConverter (no servers): which converter
settings ``attach`` takes, and the value bytes, checked against what Debezium Server
3.6 wrote for the same payloads (tests/acceptance/test_debezium_conformance.py compares
whole records against a running one)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from relay.adapters.registry.registry_format import RegistryValueEncoder
from relay.core.formats.debezium import debezium_record
from relay.core.model import OutboxEvent
from relay.core.subscribers import Subscriber, ValueFormat
from relay.engine.encoding import RecordEncoder
from relay.errors import ConfigError
from relay.ops.debezium import APICURIO_AVRO_CONVERTER, parse_options

DEBEZIUM = Subscriber("s", topic="t", value_format=ValueFormat.DEBEZIUM)
JSON_SCHEMA = '{"type":"string","connect.version":1,"connect.name":"io.debezium.data.Json"}'
AVRO = (f"value.converter={APICURIO_AVRO_CONVERTER}",)
REGISTER = ("value.converter.apicurio.registry.auto-register=true",)


def test_attach_takes_the_apicurio_avro_converter_as_a_connector_configures_it() -> None:
    options = parse_options(
        [
            "transforms.outbox.route.by.field=aggregatetype",
            *AVRO,
            *REGISTER,
            "value.converter.apicurio.registry.url=http://registry:8080/apis/registry/v2",
            "value.converter.apicurio.registry.use-id=contentId",
            "value.converter.apicurio.registry.id-handler="
            "io.apicurio.registry.serde.Default4ByteIdHandler",
        ]
    )
    assert options.value_converter == "avro"


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ((f"key.converter={APICURIO_AVRO_CONVERTER}", *AVRO, *REGISTER), "key.converter"),
        (AVRO, "auto-register=true"),
        ((*AVRO, "value.converter.apicurio.registry.auto-register=false"), "auto-register"),
        ((*AVRO, *REGISTER, "value.converter.apicurio.registry.use-id=globalId"), "use-id"),
        (
            (
                *AVRO,
                *REGISTER,
                "value.converter.apicurio.registry.id-handler="
                "io.apicurio.registry.serde.Legacy8ByteIdHandler",
            ),
            "id-handler",
        ),
        ((*AVRO, *REGISTER, "value.converter.apicurio.registry.headers.enabled=true"), "headers"),
        ((*AVRO, *REGISTER, "table.expand.json.payload=true"), "expand"),
        ((*AVRO, *REGISTER, "table.fields.additional.placement=t:envelope"), "envelope"),
        (("value.converter.apicurio.registry.auto-register=true",), "AvroConverter"),
    ],
)
def test_attach_refuses_what_the_relay_would_not_write_as_the_converter_does(
    given: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_options(given)


def copied(payload: str | None, kind: str, schema: str, tombstone: bool = False) -> OutboxEvent:
    descriptor = {
        "topic": "outbox.event.Order",
        "route": "Order",
        "key": "o-2",
        "id": "evt-1",
        "payload": payload,
        "payload_kind": kind,
        "headers": [],
        "converters": {
            "key": "string",
            "value": "avro",
            "header": "json",
            "header_schemas": None,
            "value_schema": schema,
            "expand": False,
            "tombstone": tombstone,
        },
    }
    return OutboxEvent(
        1, 1, uuid.uuid4(), "Order", "o-2", None, "Created", {}, {}, datetime.now(UTC),
        debezium=descriptor,
    )  # fmt: skip


class Framing:
    """The registry's side: records what was asked, frames with id 7."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def __call__(self, subject: str, schema: str, body: bytes) -> bytes:
        self.asked.append((subject, schema))
        return b"\x00\x00\x00\x00\x07" + body


# (payload, column kind, schema) -> the Avro body Debezium Server 3.6 wrote for it.
OBSERVED = [
    ('{"total": 3}', "jsonb", f'["null",{JSON_SCHEMA}]', "02187b22746f74616c223a20337d"),
    ("not json", "text", '["null","string"]', "02106e6f74206a736f6e"),
    ("   ", "text", '["null","string"]', "0206202020"),
    ('{"a": 1}', "jsonb", JSON_SCHEMA, "107b2261223a20317d"),
    ("hello", "text", '"string"', "0a68656c6c6f"),
    ("\\x00ff10", "bytea", '["null","bytes"]', "020600ff10"),
    ("\\x", "bytea", '["null","bytes"]', "0200"),
]


@pytest.mark.parametrize(("payload", "kind", "schema", "body"), OBSERVED)
def test_values_are_the_converters_bytes_under_the_topics_value_subject(
    payload: str, kind: str, schema: str, body: str
) -> None:
    framing = Framing()
    record = debezium_record(copied(payload, kind, schema), DEBEZIUM, framing)
    assert record.value == b"\x00\x00\x00\x00\x07" + bytes.fromhex(body)
    assert framing.asked == [("outbox.event.Order-value", schema)]
    assert record.key == b"o-2"


def test_a_null_or_tombstoned_payload_is_a_null_value_with_no_registry_call() -> None:
    framing = Framing()
    for event in (
        copied(None, "jsonb", f'["null",{JSON_SCHEMA}]'),
        copied(" ", "text", '["null","string"]', tombstone=True),
    ):
        assert debezium_record(event, DEBEZIUM, framing).value is None
    assert framing.asked == []


def test_a_relay_without_a_schema_registry_halts_rather_than_poisoning() -> None:
    with pytest.raises(ConfigError, match="schema_registry_url"):
        debezium_record(copied("x", "text", '"string"'), DEBEZIUM)


class Client:
    """The registry client's ``register_schema``: id 9 for any schema, calls recorded;
    ``get_schema(9)``: the schema last registered (the relay checks a new id)."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, str]] = []

    def register_schema(self, subject: str, schema: Any) -> int:
        self.registered.append((subject, schema.schema_str))
        return 9

    def get_schema(self, schema_id: int) -> Any:
        assert schema_id == 9
        return SimpleNamespace(schema_str=self.registered[-1][1])


def test_the_relays_registry_serves_the_debezium_format_without_a_schemas_folder() -> None:
    client = Client()
    values = RegistryValueEncoder(None, cast(SchemaRegistryClient, client))
    encoder = RecordEncoder(None, schema_registry=values)
    for _ in range(2):
        record = encoder.encode(copied("hello", "text", '"string"'), DEBEZIUM)
        assert record.value == b"\x00\x00\x00\x00\x09\x0ahello"
    # Registered as the converter sent it, once: the id is cached per subject and text.
    assert client.registered == [("outbox.event.Order-value", '"string"')]
    avro_registry = Subscriber("r", topic="t", value_format=ValueFormat.AVRO_REGISTRY)
    with pytest.raises(ConfigError, match="schemas_dir"):
        encoder.encode(copied("x", "text", '"string"')._replace(debezium=None), avro_registry)
