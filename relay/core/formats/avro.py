"""The ``avro`` value format: the payload as an Avro body, written with the writer
schema of its event type from the schemas folder (relay/core/schemas.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.core.formats.base import Configured, Encoders, Format, Subscribed, ValueWriter
from relay.errors import ConfigError, EncodingError, PayloadValidationError

if TYPE_CHECKING:
    from relay.core.model import OutboxEvent


def _values(encoders: Encoders, subscriber: Subscribed) -> ValueWriter:
    def avro_value(event: OutboxEvent, topic: str) -> bytes:
        registry = encoders.registry
        if registry is None:
            # The relay's configuration, never the row's fault: no dead letter (issue #28).
            name = subscriber.name
            raise ConfigError(
                f"subscriber {name!r} publishes avro, but this relay has no "
                "schemas folder (schemas_dir, RELAY_SCHEMAS_DIR or --schemas-dir): configure "
                "it, or switch the subscriber to json, then `outbox-relay subscribers resume "
                f"{name}`"
            )
        try:
            return registry.encode(event.event_type, event.payload)
        except PayloadValidationError as exc:
            raise EncodingError(
                f"event {event.message_id} cannot be encoded as Avro: {exc}"
            ) from exc

    return avro_value


def _refusal(name: str, settings: Configured, has_schemas: bool) -> str | None:
    """Without writer schemas every event would fail: refused, naming the keys."""
    if has_schemas:
        return None
    return (
        f"subscriber {name!r} publishes avro, which needs the writer schemas, and no "
        "schemas folder is configured (schemas_dir, RELAY_SCHEMAS_DIR or --schemas-dir); "
        f"configure it as the relay has it, or publish json: outbox-relay subscribers "
        f"set {name} --format json"
    )


FORMAT = Format(values=_values, refusal=_refusal, local=True)
