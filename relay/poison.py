"""Poison events: what a subscriber does with an event it cannot publish.

An event is poison when it cannot be encoded (payload does not match its schema,
unknown event type, illegal topic) or when the broker rejects the record itself (too
large, invalid). Under the ``dead-letter`` policy it is published instead to the
dead-letter topic, as a JSON document carrying the error, in the same Kafka
transaction as the rest of its batch.
"""

from __future__ import annotations

import json
from typing import Any

from relay.encoding import headers_for
from relay.model import RESERVED_HEADER_PREFIX, KafkaRecord, OutboxEvent, Unreadable
from relay.ports import DeadLetterDecision
from relay.subscribers import Subscriber

HEADER_ERROR = RESERVED_HEADER_PREFIX + "error"
HEADER_ORIGINAL_SUBSCRIBER = RESERVED_HEADER_PREFIX + "subscriber"
# Keep dead letters publishable even when the payload is what made the event poison.
MAX_DEAD_LETTER_PAYLOAD_BYTES = 256 * 1024


def dead_letter_record(
    event: OutboxEvent, subscriber: Subscriber, decision: DeadLetterDecision
) -> KafkaRecord:
    """The dead letter of ``event``. Never raises: whatever made the event poison (an
    unreadable or unwritable payload or header) is left out of it and named instead."""
    error = decision.error
    document: dict[str, Any] = {
        "error": error,
        "subscriber": subscriber.name,
        "message_id": str(event.message_id),
        "transaction_id": event.transaction_id,
        "position": event.position,
        "aggregate_type": event.aggregate_type,
        "aggregate_id": event.aggregate_id,
        "aggregate_version": event.aggregate_version,
        "event_type": event.event_type,
        "occurred_at": event.occurred_at.isoformat(),
    }
    headers = _json_or_reason(event.headers)
    if isinstance(headers, bytes):
        document["headers"] = event.headers
    else:
        document["headers_omitted"] = headers
    payload = _json_or_reason(event.payload)
    if isinstance(payload, str):
        document["payload_omitted"] = payload
    elif len(payload) <= MAX_DEAD_LETTER_PAYLOAD_BYTES:
        document["payload"] = event.payload
    else:
        document["payload_omitted_bytes"] = len(payload)
    return KafkaRecord(
        topic=decision.topic,
        key=event.aggregate_id.encode(),
        value=json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode(),
        headers=[
            *_safe_headers(event),
            (HEADER_ERROR, error.encode()),
            (HEADER_ORIGINAL_SUBSCRIBER, subscriber.name.encode()),
        ],
    )


def _json_or_reason(value: Any) -> bytes | str:
    """``value`` as compact JSON, or why it cannot be written."""
    if isinstance(value, Unreadable):
        return str(value)
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, TypeError, RecursionError) as exc:
        return f"cannot be written as JSON ({type(exc).__name__}: {exc})"


def _safe_headers(event: OutboxEvent) -> list[tuple[str, str | bytes | None]]:
    """The event's record headers; the relay's own only when the writer's are at fault."""
    try:
        return headers_for(event)
    except Exception:  # the writer's headers made the event poison: keep ours
        return headers_for(event._replace(headers={}))
