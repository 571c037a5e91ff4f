"""The debezium format drops a row's headers that could pass for the relay's own (no
servers): a forged `id` or `outbox.*` header, from a header field or the tracing column."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from relay.core.formats.debezium import debezium_record
from relay.core.model import OutboxEvent
from relay.core.subscribers import Subscriber, ValueFormat
from relay.errors import ConfigError
from relay.ops.debezium import parse_options

DEBEZIUM = Subscriber("s", topic="t", value_format=ValueFormat.DEBEZIUM)


def copied(headers: list[list[str]], trace: str | None, header: str = "simple") -> OutboxEvent:
    descriptor = {
        "topic": "outbox.event.order",
        "route": "order",
        "key": "k",
        "id": "evt-1",
        "payload": '{"n": 1}',
        "payload_kind": "text",
        "trace": trace,
        "headers": headers,
        "converters": {
            "key": "string",
            "value": "string",
            "header": header,
            "header_schemas": [f'{{"type":"string","n":{i}}}' for i in range(len(headers) + 1)],
            "expand": False,
            "tombstone": False,
        },
    }
    return OutboxEvent(
        1, 1, uuid.uuid4(), "order", "k", None, "Created", {"n": 1}, {}, datetime.now(UTC),
        debezium=descriptor,
    )  # fmt: skip


@pytest.mark.parametrize("header", ["simple", "json", "json-schema"])
def test_forged_relay_headers_are_dropped_from_header_fields_and_tracing(header: str) -> None:
    event = copied(
        [["outbox.error", "poisoned"], ["id", "second-id"], ["tenant", "t-1"]],
        "traceparent=00-abc-def-01\noutbox.subscriber=other\nid=third-id",
        header,
    )
    record = debezium_record(event, DEBEZIUM)
    names = [name for name, _ in record.headers]
    assert names == ["id", "tenant", "traceparent"]
    if header == "json-schema":  # each kept header keeps its own schema
        assert record.headers[1][1] == b'{"schema":{"type":"string","n":3},"payload":"t-1"}'


def test_attach_refuses_a_header_alias_that_is_the_relays_own() -> None:
    for alias in ("id", "outbox.error"):
        with pytest.raises(ConfigError, match="relay's own"):
            parse_options([f"table.fields.additional.placement=kind:header:{alias}"])
    parse_options(["table.fields.additional.placement=kind:header:eventType"])
