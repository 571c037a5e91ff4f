"""A record's key or value decoded by the format its first bytes name
(relay/core/value_decoding.py), as `outbox-relay topics tail` shows it."""

from __future__ import annotations

import base64
import decimal
import io
from pathlib import Path
from typing import Any

import fastavro
import pytest

from relay.core.schemas import SchemaFolder
from relay.core.value_decoding import decode, jsonable
from relay.errors import SchemaRegistryUnavailable

DEMO = Path(__file__).resolve().parents[3] / "schemas" / "demo"
ORDER = {"order_id": "42", "customer_id": "c-7", "amount_cents": 1250}
# As read back: the writer schema's defaults filled in.
READ = {**ORDER, "currency": "EUR", "note": None}


@pytest.fixture(scope="module")
def schemas() -> SchemaFolder:
    return SchemaFolder.from_dir(DEMO)


def wire(schema_id: int, schema: Any, datum: Any) -> bytes:
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, datum)
    return b"\x00" + schema_id.to_bytes(4, "big") + body.getvalue()


def test_json_text_bytes_and_null_are_told_apart() -> None:
    assert decode(b'{"a": [1, 2]}', None, None).as_dict() == {
        "encoding": "json",
        "content": {"a": [1, 2]},
    }
    assert decode(b"42", None, None).content == 42
    assert (decode(b"order 42", None, None).encoding, decode(b"order 42", None, None).content) == (
        "text",
        "order 42",
    )
    raw = decode(b"\xff\xfe", None, None)
    assert (raw.encoding, raw.content, raw.problem) == ("bytes", "//4=", None)
    assert decode(None, None, None).as_dict() == {"encoding": "null", "content": None}


def test_an_avro_single_object_value_is_decoded_with_its_writer_schema(
    schemas: SchemaFolder,
) -> None:
    value = schemas.encode("OrderPlaced", ORDER)
    decoded = decode(value, schemas, None)
    assert decoded.encoding == "avro" and decoded.content == READ
    assert decoded.schema == schemas.writer_for("OrderPlaced").full_name


def test_avro_without_its_schema_is_shown_as_bytes_saying_what_is_missing(
    schemas: SchemaFolder, tmp_path: Path
) -> None:
    value = schemas.encode("OrderPlaced", ORDER)
    without = decode(value, None, None)
    assert without.encoding == "bytes" and "give --schemas-dir" in str(without.problem)
    assert base64.b64decode(without.content) == value
    other = decode(value, SchemaFolder.from_dir(tmp_path), None)  # an empty folder
    assert other.encoding == "bytes" and "unknown writer schema fingerprint" in str(other.problem)


def test_a_confluent_wire_value_is_decoded_with_the_registry_s_schema(
    schemas: SchemaFolder,
) -> None:
    parsed = schemas.writer_for("OrderPlaced").parsed
    asked: list[int] = []

    def by_id(schema_id: int) -> Any:
        asked.append(schema_id)
        return parsed

    decoded = decode(wire(7, parsed, READ), None, by_id)
    assert (decoded.encoding, decoded.content, decoded.schema) == ("avro-registry", READ, "7")
    assert asked == [7]


def test_a_wire_value_without_a_registry_or_with_the_registry_down_is_bytes(
    schemas: SchemaFolder,
) -> None:
    value = wire(7, schemas.writer_for("OrderPlaced").parsed, READ)
    assert "give --schema-registry-url" in str(decode(value, None, None).problem)

    def down(schema_id: int) -> Any:
        raise SchemaRegistryUnavailable("schema registry unreachable")

    decoded = decode(value, None, down)
    assert decoded.encoding == "bytes" and "(schema id 7): schema registry unreachable" in str(
        decoded.problem
    )


def test_a_body_that_does_not_fit_its_schema_is_bytes_not_an_error(
    schemas: SchemaFolder,
) -> None:
    truncated = schemas.encode("OrderPlaced", ORDER)[:12]
    assert decode(truncated, schemas, None).encoding == "bytes"


def test_avro_data_is_made_json_shaped() -> None:
    assert jsonable({"b": b"\x00\x01", "d": decimal.Decimal("1.50"), "l": [b"x"]}) == {
        "b": "AAE=",
        "d": "1.50",
        "l": ["eA=="],
    }
