"""A record's key or value read back as a person looks at it (`outbox-relay topics
tail`): whichever format the relay wrote it in, recognised by its first bytes.

- ``C3 01`` and an 8-byte fingerprint: Avro single-object encoding (the ``avro``
  format), decoded with the writer schema of that fingerprint from the schemas folder;
- a zero byte and a 4-byte id: the Confluent wire format (``avro-registry``, and
  ``debezium`` values through Avro converters), decoded with the registry's schema;
- anything else: JSON (``json``, ``debezium``), else UTF-8 text, else bytes.

A value that cannot be decoded is shown as bytes with the reason, never an error: a
topic may hold records of any producer.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import io
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fastavro

from relay.core.schemas import SINGLE_OBJECT_MAGIC, SchemaFolder
from relay.errors import RelayError

__all__ = ["Decoded", "WriterById", "decode"]

# The parsed writer schema a registry holds under an id (raises RelayError if it cannot
# be had); the registry adapter's, handed in.
WriterById = Callable[[int], Any]

_FINGERPRINT_LEN = 8
_WIRE_MAGIC = b"\x00"
_WIRE_HEADER_LEN = 5


@dataclass(frozen=True)
class Decoded:
    """What a key or value holds: ``encoding`` (avro, avro-registry, json, text, bytes or
    null), the decoded content (JSON-shaped), and, for Avro, the writer schema's name or
    registry id; ``problem`` says why it is shown as bytes when it looked decodable."""

    encoding: str
    content: Any
    schema: str | None = None
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"encoding": self.encoding, "content": self.content}
        if self.schema is not None:
            shown["schema"] = self.schema
        if self.problem is not None:
            shown["problem"] = self.problem
        return shown


def decode(data: bytes | None, schemas: SchemaFolder | None, by_id: WriterById | None) -> Decoded:
    """``data`` decoded by the format its first bytes name."""
    if data is None:
        return Decoded("null", None)
    if data.startswith(SINGLE_OBJECT_MAGIC) and len(data) >= 2 + _FINGERPRINT_LEN:
        return _single_object(data, schemas)
    if data.startswith(_WIRE_MAGIC) and len(data) >= _WIRE_HEADER_LEN:
        return _wire(data, by_id)
    return _plain(data)


def _single_object(data: bytes, schemas: SchemaFolder | None) -> Decoded:
    fingerprint = data[2 : 2 + _FINGERPRINT_LEN].hex()
    if schemas is None:
        return _undecoded(
            data, f"Avro single-object (fingerprint {fingerprint}): give --schemas-dir"
        )
    try:
        writer, content = schemas.decode(data)
    except (RelayError, ValueError, EOFError, IndexError) as exc:
        return _undecoded(data, f"Avro single-object (fingerprint {fingerprint}): {exc}")
    return Decoded("avro", jsonable(content), schema=writer.full_name)


def _wire(data: bytes, by_id: WriterById | None) -> Decoded:
    schema_id = int.from_bytes(data[1:_WIRE_HEADER_LEN], "big")
    if by_id is None:
        return _undecoded(
            data, f"Confluent wire format (schema id {schema_id}): give --schema-registry-url"
        )
    try:
        writer = by_id(schema_id)
        content = fastavro.schemaless_reader(io.BytesIO(data[_WIRE_HEADER_LEN:]), writer)
    except (RelayError, ValueError, EOFError, IndexError) as exc:
        return _undecoded(data, f"Confluent wire format (schema id {schema_id}): {exc}")
    return Decoded("avro-registry", jsonable(content), schema=str(schema_id))


def _plain(data: bytes) -> Decoded:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return _undecoded(data, None)
    try:
        return Decoded("json", json.loads(text))
    except ValueError:
        return Decoded("text", text)


def _undecoded(data: bytes, problem: str | None) -> Decoded:
    return Decoded("bytes", base64.b64encode(data).decode(), problem=problem)


def jsonable(value: Any) -> Any:
    """An Avro datum as JSON takes it: bytes in base64, logical types as text."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    return value
