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
from relay.model import KafkaRecord, OutboxEvent
from relay.store import DeadLetterDecision
from relay.subscribers import Subscriber

HEADER_ERROR = "outbox.error"
HEADER_ORIGINAL_SUBSCRIBER = "outbox.subscriber"
# Keep dead letters publishable even when the payload is what made the event poison.
MAX_DEAD_LETTER_PAYLOAD_BYTES = 256 * 1024


def dead_letter_record(
    event: OutboxEvent, subscriber: Subscriber, decision: DeadLetterDecision
) -> KafkaRecord:
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
        "headers": event.headers,
    }
    payload = json.dumps(event.payload, separators=(",", ":"), ensure_ascii=False)
    if len(payload.encode()) <= MAX_DEAD_LETTER_PAYLOAD_BYTES:
        document["payload"] = event.payload
    else:
        document["payload_omitted_bytes"] = len(payload.encode())
    return KafkaRecord(
        topic=decision.topic,
        key=event.aggregate_id.encode(),
        value=json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode(),
        headers=[
            *headers_for(event),
            (HEADER_ERROR, error.encode()),
            (HEADER_ORIGINAL_SUBSCRIBER, subscriber.name.encode()),
        ],
    )
