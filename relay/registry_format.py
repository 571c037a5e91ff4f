"""Avro values in the Confluent wire format, with schema ids from a schema registry:
the core of the ``avro-registry`` value format (issue #32). Not wired into the encoder
or the settings yet.

The writer schema of an event type comes from the relay's schema folder, as for the
``avro`` format; its id is what the registry returns when the schema is registered
under the topic's subject (``<topic>-value``, Confluent's TopicNameStrategy). Ids are
cached per (subject, schema fingerprint): the registry is asked once per schema and
topic, not per event. A schema the registry refuses (incompatible with the subject's
history) is an :class:`EncodingError` carrying the registry's reason; a registry that
cannot be reached is retryable, never a poison event.

Schemas that reference named types of other files are not supported yet (the registry
would need them as references). It imports the Confluent client's schema-registry
extra, for now a dev dependency only: wiring the format in makes it a runtime one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from relay.confluent_wire import from_single_object
from relay.errors import EncodingError, SchemaRegistryUnavailable
from relay.schemas import AvroSchema, SchemaFolder, encode_with

__all__ = ["RegistryValueEncoder", "SchemaRegistryUnavailable"]

_log = logging.getLogger(__name__)

# Statuses that say "this schema, under this subject, is refused" rather than "the
# registry is unwell": 409 incompatible, 422 invalid schema.
_REFUSALS = frozenset({409, 422})


class RegistryValueEncoder:
    """``encode(topic, event_type, payload)``: the wire-format value of one event."""

    def __init__(self, schemas: SchemaFolder, client: SchemaRegistryClient) -> None:
        self.schemas = schemas
        self.client = client
        self._ids: dict[tuple[str, bytes], int] = {}

    def encode(self, topic: str, event_type: str, payload: Any) -> bytes:
        schema = self.schemas.writer_for(event_type)
        schema_id = self.schema_id(f"{topic}-value", schema)
        return from_single_object(encode_with(schema, payload), schema_id)

    def schema_id(self, subject: str, schema: AvroSchema) -> int:
        """The registry id of ``schema`` under ``subject``, registering it if new."""
        key = (subject, schema.fingerprint)
        cached = self._ids.get(key)
        if cached is not None:
            return cached
        schema_id = self._register(subject, schema)
        self._ids[key] = schema_id
        _log.info(
            "schema %s has id %s under %s",
            schema.full_name,
            schema_id,
            subject,
            extra={"event": "registry.schema_id"},
        )
        return schema_id

    def _register(self, subject: str, schema: AvroSchema) -> int:
        # The parsed schema keeps defaults and docs (the parsing canonical form drops
        # them, and the registry's compatibility checks need the defaults).
        text = json.dumps(schema.parsed, separators=(",", ":"))
        try:
            return int(self.client.register_schema(subject, Schema(text, "AVRO")))
        except SchemaRegistryError as exc:
            if exc.http_status_code in _REFUSALS:
                raise EncodingError(
                    f"the schema registry refused {schema.full_name} under {subject!r}: "
                    f"{exc.error_message}"
                ) from exc
            raise SchemaRegistryUnavailable(
                f"schema registry error for {subject!r}: {exc}"
            ) from exc
        except Exception as exc:  # the client's transport raises its own (httpx) errors
            raise SchemaRegistryUnavailable(
                f"schema registry unreachable for {subject!r}: {type(exc).__name__}: {exc}"
            ) from exc
