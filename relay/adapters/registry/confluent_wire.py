"""The Confluent wire format of a schema-registry value: a zero byte, the schema's
registry id (4 bytes, big-endian), then the Avro body, the same schemaless body the
relay's ``avro`` format writes after its single-object header (relay/core/schemas.py).

Only the framing lives here: looking ids up in a registry is the value format's job
(issue #32). Functions, no I/O.
"""

from __future__ import annotations

from relay.core.schemas import SINGLE_OBJECT_MAGIC
from relay.errors import EncodingError

__all__ = ["MAGIC", "MAX_ID", "frame", "from_single_object", "is_registry_id", "unframe"]

MAGIC = b"\x00"
_ID_BYTES = 4
_HEADER_LEN = len(MAGIC) + _ID_BYTES
_SINGLE_OBJECT_HEADER_LEN = len(SINGLE_OBJECT_MAGIC) + 8
MAX_ID = 2**31 - 1  # registries hand out ids as Java ints


def is_registry_id(schema_id: int) -> bool:
    """Whether ``schema_id`` can be a registry's schema id (and so framed)."""
    return 0 <= schema_id <= MAX_ID


def frame(schema_id: int, body: bytes) -> bytes:
    """``body`` (schemaless Avro) framed for the registry schema ``schema_id``."""
    if not is_registry_id(schema_id):
        raise EncodingError(f"schema id {schema_id} is not a registry id (0..{MAX_ID})")
    return MAGIC + schema_id.to_bytes(_ID_BYTES, "big") + body


def unframe(value: bytes) -> tuple[int, bytes]:
    """The schema id and the Avro body of a wire-format value."""
    if len(value) < _HEADER_LEN or value[:1] != MAGIC:
        raise EncodingError(
            f"not a schema-registry value: {len(value)} bytes starting {value[:_HEADER_LEN].hex()!r}"
            f" (expected {MAGIC.hex()} and a 4-byte schema id)"
        )
    return int.from_bytes(value[1:_HEADER_LEN], "big"), value[_HEADER_LEN:]


def from_single_object(value: bytes, schema_id: int) -> bytes:
    """An ``avro`` (single-object encoded) value re-framed for registry id ``schema_id``:
    the body is the same bytes, only the header differs."""
    if len(value) < _SINGLE_OBJECT_HEADER_LEN or not value.startswith(SINGLE_OBJECT_MAGIC):
        raise EncodingError(
            f"not an Avro single-object value: {len(value)} bytes starting "
            f"{value[:_SINGLE_OBJECT_HEADER_LEN].hex()!r}"
        )
    return frame(schema_id, value[_SINGLE_OBJECT_HEADER_LEN:])
