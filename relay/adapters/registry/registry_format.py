"""Avro values in the Confluent wire format, with schema ids from a schema registry:
the ``avro-registry`` value format (issue #32).

The writer schema of an event type comes from the relay's schema folder, as for the
``avro`` format; its id is what the registry returns when the schema is registered
under the subscriber's subject (by default ``<topic>-value``, Confluent's
TopicNameStrategy; see :class:`SubjectStrategy`). Ids are cached per (subject, schema
fingerprint) for the life of the process: the registry is asked once per schema and
subject, not per event, and again after a restart (never persisted: an id remembered
from a registry since wiped or replaced would point at another schema). Keys are the
aggregate_id, as text or (``key_format`` avro-registry) as an Avro string under
``<topic>-key``. Each id is checked before it is first used, and a 409 confirmed with
the registry's compatibility test (relay/adapters/registry/registration.py). A schema
the registry refuses (incompatible with the subject's history) is
:class:`SchemaIncompatible`, a configuration error carrying the registry's reason (the
part halts; no event is dead-lettered for it); a registry that cannot be reached, or
answers what cannot be right, is retryable, never a poison event, and its answer is
not cached.

Schemas that reference named types of other files are not supported yet (the registry
would need them as references).
"""

from __future__ import annotations

import io
import logging
import threading
from datetime import UTC, datetime
from typing import Any

import fastavro
from confluent_kafka.schema_registry import SchemaRegistryClient

from relay.adapters.registry.confluent_wire import frame, from_single_object
from relay.adapters.registry.registration import Registrar
from relay.adapters.registry.registry_compat import KEY_SCHEMA, schema_text
from relay.core.log_fields import log_extra
from relay.core.schemas import AvroSchema, SchemaFolder, encode_with
from relay.core.settings import Settings
from relay.core.subscribers import SubjectStrategy
from relay.errors import (
    ConfigError,
    SchemaIncompatible,
    SchemaRegistryFault,
    SchemaRegistryUnavailable,
)

__all__ = [
    "RegistryValueEncoder",
    "SchemaIncompatible",
    "SchemaRegistryUnavailable",
    "encoder_for",
    "registry_client",
]

_log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
_MAX_TEXT_IDS = 4096


def registry_client(
    url: str,
    *,
    user: str | None = None,
    password: str | None = None,
    ca_location: str | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> SchemaRegistryClient:
    """The Confluent client for the registry at ``url``, with basic auth, a CA and a
    timeout per request (seconds)."""
    # The client's default is no timeout at all: a registry that accepts connections
    # and never answers would hold a part (or the start-up check) forever.
    config: dict[str, Any] = {"url": url, "timeout": timeout}
    if user is not None:
        config["basic.auth.user.info"] = f"{user}:{password or ''}"
    if ca_location is not None:
        config["ssl.ca.location"] = ca_location
    return SchemaRegistryClient(config)


def encoder_for(settings: Settings, schemas: SchemaFolder | None) -> RegistryValueEncoder | None:
    """The registry encoder the settings configure; None without a registry URL. Without
    writer schemas it serves the debezium format's AvroConverter values only (an
    avro-registry subscriber then halts, naming the keys)."""
    client = client_for(settings)
    return None if client is None else RegistryValueEncoder(schemas, client)


def client_for(settings: Settings) -> SchemaRegistryClient | None:
    """The client of the registry the settings configure (None: no registry URL)."""
    if settings.schema_registry_url is None:
        return None
    password = settings.schema_registry_password
    return registry_client(
        settings.schema_registry_url,
        user=settings.schema_registry_user,
        password=None if password is None else password.get_secret_value(),
        ca_location=None
        if settings.schema_registry_ca is None
        else str(settings.schema_registry_ca),
    )


class RegistryValueEncoder:
    """``encode(topic, event_type, payload)``: the wire-format value of one event."""

    def __init__(self, schemas: SchemaFolder | None, client: SchemaRegistryClient) -> None:
        self.schemas = schemas
        self.client = client
        self._registrar = Registrar(client)
        self._ids: dict[tuple[str, bytes], int] = {}
        self._key_ids: dict[str, int] = {}
        self._text_ids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        # Why the registry could not be reached, and since when (None: it answers). Its
        # parts say so each retry; this says it once per outage (event registry.unreachable).
        self.unreachable: tuple[datetime, str] | None = None
        self._failed = 0  # registrations failed since (counted, not logged)

    def encode(
        self,
        topic: str,
        event_type: str,
        payload: Any,
        strategy: SubjectStrategy = SubjectStrategy.TOPIC,
    ) -> bytes:
        if self.schemas is None:
            raise ConfigError(
                "avro-registry values need writer schemas: configure schemas_dir "
                "(RELAY_SCHEMAS_DIR)"
            )
        schema = self.schemas.writer_for(event_type)
        schema_id = self.schema_id(strategy.subject(topic, schema.full_name), schema)
        return from_single_object(encode_with(schema, payload), schema_id)

    def encode_key(self, topic: str, key: str) -> bytes:
        """The wire-format key: ``key`` as an Avro string, its schema (``"string"``)
        registered under ``<topic>-key``, as stock key serializers do (TopicNameStrategy)."""
        subject = f"{topic}-key"
        schema_id = self._key_ids.get(subject)
        if schema_id is None:
            schema_id = self._register_text(subject, KEY_SCHEMA, f"the key schema {KEY_SCHEMA}")
            self._key_ids[subject] = schema_id
            _log.info(
                "key schema has id %s under %s",
                schema_id,
                subject,
                extra=log_extra("registry_schema_id", subject=subject, schema_id=schema_id),
            )
        return frame(schema_id, _avro_string(key))

    def frame_text(self, subject: str, text: str, body: bytes) -> bytes:
        """``body`` framed with the id of the Avro schema ``text`` under ``subject``."""
        return frame(self.text_schema_id(subject, text), body)

    def text_schema_id(self, subject: str, text: str) -> int:
        """The registry id of the Avro schema ``text`` (registered as it is, so the
        registry sees the same content a converter sent) under ``subject``."""
        key = (subject, text)
        schema_id = self._text_ids.get(key)
        if schema_id is None:
            schema_id = self._register_text(subject, text, f"the schema {text}")
            if len(self._text_ids) >= _MAX_TEXT_IDS:  # routed topics: stay bounded
                self._text_ids.clear()
            self._text_ids[key] = schema_id
            _log.info(
                "schema %s has id %s under %s",
                text,
                schema_id,
                subject,
                extra=log_extra("registry_schema_id", subject=subject, schema_id=schema_id),
            )
        return schema_id

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
            extra=log_extra("registry_schema_id", subject=subject, schema_id=schema_id),
        )
        return schema_id

    def _register(self, subject: str, schema: AvroSchema) -> int:
        return self._register_text(subject, schema_text(schema), schema.full_name)

    def _register_text(self, subject: str, text: str, what: str) -> int:
        try:
            schema_id = self._registrar.register(subject, text, what)
        except SchemaRegistryUnavailable as exc:
            self._note_unreachable(exc)
            raise
        self._note_reachable()
        return schema_id

    def _note_unreachable(self, exc: SchemaRegistryUnavailable) -> None:
        with self._lock:
            self._failed += 1
            if self.unreachable is not None:
                return  # logged once per outage; the later failures are counted
            self.unreachable = (datetime.now(UTC), str(exc))
        _log.warning(
            "schema registry %s: parts that need a schema id wait for it (nothing is "
            "dead-lettered, no answer kept): %s",
            "answers wrongly" if isinstance(exc, SchemaRegistryFault) else "unreachable",
            exc,
            # A documented name (docs/configuration.md, deploy/prometheus/alerts.yml): dotted, unlike
            # the others, and kept so that operators' filters keep matching.
            extra=log_extra("registry.unreachable", error=exc),
        )

    def _note_reachable(self) -> None:
        with self._lock:
            down, self.unreachable = self.unreachable, None
            failed, self._failed = self._failed, 0
        if down is not None:
            _log.info(
                "schema registry reachable again (unreachable since %s; %d requests failed)",
                down[0].isoformat(timespec="seconds"),
                failed,
                extra=log_extra("registry.reachable", since=down[0].isoformat(), failed=failed),
            )


def _avro_string(text: str) -> bytes:
    """``text`` in Avro's binary encoding (its length, then its UTF-8 bytes)."""
    body = io.BytesIO()
    fastavro.schemaless_writer(body, "string", text)
    return body.getvalue()
