"""The Confluent wire-format framing (relay/adapters/registry/confluent_wire.py)."""

from __future__ import annotations

import pytest

from relay.adapters.registry.confluent_wire import frame, from_single_object, unframe
from relay.core.schemas import AvroSchema, encode_with
from relay.errors import EncodingError

ORDER = AvroSchema.from_json(
    {"type": "record", "name": "Order", "fields": [{"name": "id", "type": "long"}]}
)


def test_frame_puts_a_zero_byte_and_the_big_endian_id_before_the_body() -> None:
    assert frame(258, b"body") == b"\x00\x00\x00\x01\x02body"
    assert unframe(frame(2**31 - 1, b"")) == (2**31 - 1, b"")


@pytest.mark.parametrize("schema_id", [-1, 2**31])
def test_frame_refuses_an_id_a_registry_cannot_have(schema_id: int) -> None:
    with pytest.raises(EncodingError, match="not a registry id"):
        frame(schema_id, b"")


@pytest.mark.parametrize("value", [b"", b"\x00\x00\x01", b"\xc3\x01\x00\x00\x00\x00body"])
def test_unframe_refuses_what_is_not_a_registry_value(value: bytes) -> None:
    with pytest.raises(EncodingError, match="not a schema-registry value"):
        unframe(value)


def test_a_single_object_value_keeps_its_avro_body() -> None:
    single = encode_with(ORDER, {"id": 7})

    reframed = from_single_object(single, 5)

    assert unframe(reframed) == (5, single[10:])
    assert single[10:] == b"\x0e"  # zig-zag varint of 7


def test_from_single_object_refuses_other_values() -> None:
    with pytest.raises(EncodingError, match="not an Avro single-object value"):
        from_single_object(b"\x00\x00\x00\x00\x01\x0e", 1)
