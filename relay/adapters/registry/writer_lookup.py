"""The writer schemas a schema registry holds, by id: what a reader of the Confluent wire
format needs (`outbox-relay topics tail`). Asked through the registry's client, once per
id (an id's schema never changes)."""

from __future__ import annotations

import json
import threading
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from fastavro.schema import parse_schema

from relay.adapters.registry.registry_errors import registry_call
from relay.errors import SchemaRegistryFault

__all__ = ["RegistryWriters"]


class RegistryWriters:
    """``writers(schema_id)``: the parsed Avro schema the registry holds under the id.
    Raises :class:`SchemaRegistryUnavailable` or :class:`SchemaRegistryFault` (a schema
    that is not Avro, or that fastavro cannot parse)."""

    def __init__(self, client: SchemaRegistryClient) -> None:
        self._client = client
        self._parsed: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, schema_id: int) -> Any:
        with self._lock:
            known = self._parsed.get(schema_id)
        if known is not None:
            return known
        subject = f"schema id {schema_id}"
        schema = registry_call(subject, lambda: self._client.get_schema(schema_id), subject)
        if (schema.schema_type or "AVRO") != "AVRO":
            raise SchemaRegistryFault(f"{subject} is a {schema.schema_type} schema, not Avro")
        try:
            parsed = parse_schema(json.loads(schema.schema_str), _write_hint=False)
        except (ValueError, TypeError, KeyError) as exc:
            raise SchemaRegistryFault(f"{subject} is no Avro schema fastavro reads: {exc}") from exc
        with self._lock:
            self._parsed[schema_id] = parsed
        return parsed
