"""outbox-relay: a transactional outbox relay for Postgres and Kafka.

Applications append events inside their own transactions::

    from relay import Outbox, SchemaFolder

    outbox = Outbox(SchemaFolder.from_dir("schemas"))
    with conn.transaction():
        outbox.append(conn, aggregate_type="order", aggregate_id="42",
                      event_type="OrderPlaced", payload={...},
                      headers=trace_headers())  # the current span's traceparent, if any
"""

from relay.core.schemas import SchemaFolder
from relay.errors import (
    ConcurrencyError,
    IdempotencyKeyReused,
    PayloadValidationError,
    RelayError,
)
from relay.write.outbox import Event, Outbox, StreamAppend, append, append_to_stream
from relay.write.trace_context import trace_headers

__all__ = [
    "ConcurrencyError",
    "Event",
    "IdempotencyKeyReused",
    "Outbox",
    "PayloadValidationError",
    "RelayError",
    "SchemaFolder",
    "StreamAppend",
    "append",
    "append_to_stream",
    "trace_headers",
]
