"""What the JSON value format puts on the wire, whatever the payload (no servers)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from relay.encoding import RecordEncoder
from relay.errors import EncodingError
from relay.model import OutboxEvent
from relay.subscribers import Subscriber, ValueFormat

JSON = Subscriber("s", topic="t", value_format=ValueFormat.JSON)


def event(payload: Any) -> OutboxEvent:
    return OutboxEvent(
        1, 1, uuid.uuid4(), "order", "k", None, "OrderPlaced", payload, {}, datetime.now(UTC)
    )


@pytest.mark.parametrize(
    "payload",
    [
        {"order_id": "o-1", "amount_cents": 1250, "note": "café ☕", "tags": [1.5, None, True]},
        {"big": 2**70, "negative": -(2**65)},  # beyond 64 bits: written all the same
        {"control": "\x00\u2028", "nested": [[[{"a": {}}]]]},
    ],
)
def test_a_json_value_is_compact_utf8_json_of_the_payload(payload: Any) -> None:
    value = RecordEncoder(None).encode(event(payload), JSON).value
    assert value is not None
    assert json.loads(value) == payload
    assert value == json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_payload_too_deep_to_write_is_that_events_poison() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(EncodingError, match="cannot be written as JSON"):
        RecordEncoder(None).encode(event(deep), JSON)
