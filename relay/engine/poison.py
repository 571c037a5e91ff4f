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

import orjson

from relay.core.model import RESERVED_HEADER_PREFIX, KafkaRecord, OutboxEvent, Unreadable
from relay.core.ports import DeadLetterDecision
from relay.core.subscribers import Subscriber
from relay.engine.encoding import headers_for

HEADER_ERROR = RESERVED_HEADER_PREFIX + "error"
HEADER_ORIGINAL_SUBSCRIBER = RESERVED_HEADER_PREFIX + "subscriber"
# Keep dead letters publishable whatever made the event poison: every field a writer
# controls is bounded, so a dead letter stays far below Kafka's 1 MB default record
# limit (about 300 KiB at most) and a dead-letter subscriber never halts over a row.
MAX_DEAD_LETTER_PAYLOAD_BYTES = 256 * 1024
MAX_DEAD_LETTER_HEADERS_BYTES = 16 * 1024  # the row's headers, as JSON
MAX_DEAD_LETTER_TEXT_BYTES = 1024  # aggregate_type, aggregate_id, event_type
MAX_DEAD_LETTER_ERROR_BYTES = 8 * 1024  # errors may quote the row (a topic, a value)
# What outbox_dead_letters and the log keep of a dead letter's error: a flood of poison
# rows is stored and logged (issue #47: 1.4 KB a row, 1.3 KB a warning). The record on
# the dead-letter topic carries it up to MAX_DEAD_LETTER_ERROR_BYTES.
MAX_STORED_ERROR_BYTES = 512


def dead_letter_record(
    event: OutboxEvent, subscriber: Subscriber, decision: DeadLetterDecision
) -> KafkaRecord:
    """The dead letter of ``event``. Never raises: whatever made the event poison (an
    unreadable, unwritable or too large) is left out of it and named instead, and the
    row's text columns are cut short with a marker; its identity (message id, key) is
    always whole."""
    error = cap(decision.error, MAX_DEAD_LETTER_ERROR_BYTES)
    short = event._replace(
        aggregate_type=cap(event.aggregate_type, MAX_DEAD_LETTER_TEXT_BYTES),
        aggregate_id=cap(event.aggregate_id, MAX_DEAD_LETTER_TEXT_BYTES),
        event_type=cap(event.event_type, MAX_DEAD_LETTER_TEXT_BYTES),
    )
    document: dict[str, Any] = {
        "error": error,
        "subscriber": subscriber.name,
        "message_id": str(event.message_id),
        "transaction_id": event.transaction_id,
        "position": event.position,
        "aggregate_type": short.aggregate_type,
        "aggregate_id": short.aggregate_id,
        "aggregate_version": event.aggregate_version,
        "event_type": short.event_type,
        "occurred_at": event.occurred_at.isoformat(),
    }
    if decision.minimal:
        document["omitted"] = "payload and headers: the broker refused the full dead letter"
        return _record(decision, short._replace(headers={}), document, [], error, subscriber)
    # The headers and payload, written once: to measure them, then as they are.
    written: list[bytes] = []
    headers = _json_or_reason(event.headers)
    if isinstance(headers, str):
        document["headers_omitted"] = headers
        short = short._replace(headers={})
    elif len(headers) > MAX_DEAD_LETTER_HEADERS_BYTES:
        document["headers_omitted_bytes"] = len(headers)
        short = short._replace(headers={})
    else:
        written.append(b'"headers":' + headers)
    payload = _json_or_reason(event.payload)
    if isinstance(payload, str):
        document["payload_omitted"] = payload
    elif len(payload) <= MAX_DEAD_LETTER_PAYLOAD_BYTES:
        written.append(b'"payload":' + payload)
    else:
        document["payload_omitted_bytes"] = len(payload)
    return _record(decision, short, document, written, error, subscriber)


def _record(
    decision: DeadLetterDecision,
    short: OutboxEvent,
    document: dict[str, Any],
    written: list[bytes],
    error: str,
    subscriber: Subscriber,
) -> KafkaRecord:
    value = _dumps(document)
    if written:  # the document's last members, already JSON
        value = b"".join((value[:-1], b",", b",".join(written), b"}"))
    record = KafkaRecord(
        topic=decision.topic,
        key=short.aggregate_id.encode(),
        value=value,
        headers=[
            *_safe_headers(short),
            (HEADER_ERROR, error.encode()),
            (HEADER_ORIGINAL_SUBSCRIBER, subscriber.name.encode()),
        ],
    )
    return record._replace(size=record.byte_size())  # counted once: the cut and stats read it


def cap(text: str, limit: int) -> str:
    """``text`` if its UTF-8 is at most ``limit`` bytes, else its start with a marker
    that says how long it was (in bytes)."""
    if len(text) * 4 <= limit:  # no need to encode: even 4 bytes a character fit
        return text
    encoded = text.encode(errors="replace")
    if len(encoded) <= limit:
        return text
    start = encoded[: limit - 64].decode(errors="ignore")
    return f"{start}...[cut: {len(encoded)} bytes]"


def _json_or_reason(value: Any) -> bytes | str:
    """``value`` as compact JSON, or why it cannot be written."""
    if isinstance(value, Unreadable):
        return str(value)
    if type(value) is bytes:  # a payload passed through: Postgres's JSON text already
        return value
    try:
        return _dumps(value)
    except (ValueError, TypeError, RecursionError) as exc:
        return f"cannot be written as JSON ({type(exc).__name__}: {exc})"


def _dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON: orjson's (a dead letter each poison row of a
    flood: issue #47), copied out of the buffer it wrote into (relay/engine/encoding.py
    says why), else the standard library's (integers beyond 64 bits, deep nesting)."""
    try:
        return memoryview(orjson.dumps(value)).tobytes()
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _safe_headers(event: OutboxEvent) -> list[tuple[str, str | bytes | None]]:
    """The event's record headers; the relay's own only when the writer's are at fault."""
    try:
        return headers_for(event)
    except Exception:  # the writer's headers made the event poison: keep ours
        return headers_for(event._replace(headers={}))
