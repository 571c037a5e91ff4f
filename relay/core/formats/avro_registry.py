"""The ``avro-registry`` value format: Avro in the Confluent wire format, the schema
ids from a schema registry (relay/adapters/registry/registry_format.py encodes them;
the daemon builds it and hands it in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.core.formats.base import Configured, Encoders, Format, Subscribed, ValueWriter
from relay.errors import ConfigError, EncodingError, PayloadValidationError

if TYPE_CHECKING:
    from relay.core.model import OutboxEvent


def _values(encoders: Encoders, subscriber: Subscribed) -> ValueWriter:
    def registry_value(event: OutboxEvent, topic: str) -> bytes:
        values = encoders.schema_registry
        if values is None or values.schemas is None:
            # The relay's configuration, never the row's fault: no dead letter.
            name = subscriber.name
            raise ConfigError(
                f"subscriber {name!r} publishes avro-registry, but this relay has "
                "no schema registry or no schemas folder (schema_registry_url, "
                "RELAY_SCHEMA_REGISTRY_URL; schemas_dir, RELAY_SCHEMAS_DIR): configure them, "
                f"then `outbox-relay subscribers resume {name}`"
            )
        try:
            return values.encode(
                topic, event.event_type, event.payload, subscriber.subject_strategy
            )
        except PayloadValidationError as exc:
            raise EncodingError(
                f"event {event.message_id} cannot be encoded as Avro: {exc}"
            ) from exc

    return registry_value


def missing(settings: Configured, *, has_schemas: bool | None = None) -> str | None:
    """What an avro-registry subscriber needs and these settings lack, by key
    (``has_schemas``: whether writer schemas are loaded, if not from schemas_dir)."""
    if has_schemas is None:
        has_schemas = settings.schemas_dir is not None
    lacking = [
        f"{key} (RELAY_{key.upper()})"
        for key, present in (
            ("schema_registry_url", settings.schema_registry_url is not None),
            ("schemas_dir", has_schemas),
        )
        if not present
    ]
    return " and ".join(lacking) or None


def _refusal(name: str, settings: Configured, has_schemas: bool) -> str | None:
    """Without its registry or its schemas every event would fail: refused, naming the keys."""
    lacking = missing(settings, has_schemas=has_schemas)
    if lacking is None:
        return None
    return (
        f"subscriber {name!r} publishes avro-registry, which needs {lacking}; "
        "configure them, or switch it to another format: outbox-relay subscribers "
        f"set {name} --format json"
    )


FORMAT = Format(values=_values, refusal=_refusal, registry=True)
