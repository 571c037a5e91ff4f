"""The ``debezium`` value format: records as Debezium's Outbox Event Router publishes them.

For a row copied by ``outbox-relay debezium attach``, the trigger recorded what the
router reads from it (relay/adapters/postgres/sql/debezium.sql); this renders the record a Debezium
connector with those router options and converters would produce: the routed topic,
the key (its bytes decide the partition: the relay's producers use Kafka's Java
partitioner, murmur2), the payload as the value (or an envelope with the router's
``envelope`` fields), the ``id`` and ``header`` fields as headers, and the record
timestamp from ``table.field.event.timestamp``. Converters: StringConverter,
JsonConverter with ``schemas.enable=false``, and for values Apicurio's AvroConverter (the
payload's Avro schema, recorded by ``attach``, registered under ``<topic>-value``; the
value in the Confluent wire format). deploy/README.md lists what else differs.

What the router would refuse (no routing value, a column gone) is an
:class:`EncodingError`, so the subscriber's poison policy applies, with the reason.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import fastavro

from relay.core.formats.base import Encoders, Format, RecordWriter, Subscribed
from relay.core.model import HEADER_ID, RESERVED_HEADER_PREFIX, KafkaRecord, OutboxEvent
from relay.errors import ConfigError, EncodingError

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# Java's String.trim() drops code points up to U+0020 (the router's "empty payload").
_JAVA_BLANK = "".join(map(chr, range(33)))
# A properties line: name, then = or : (comments start with # or !).
_PROPERTY = re.compile(r"^\s*([^#!=:\s][^=:\s]*)\s*[=:](.*)$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Header = tuple[str, str | bytes | None]
# An Avro body in the Confluent wire format: (subject, schema text, body) to the framed
# value, the schema registered under the subject if new (the registry's value encoder).
RegistryFraming = Callable[[str, str, bytes], bytes]


def debezium_record(
    event: OutboxEvent, subscriber: Subscribed, registry: RegistryFraming | None = None
) -> KafkaRecord:
    """The record Debezium's Outbox Event Router would publish for ``event``
    (``registry``: the relay's schema registry, for AvroConverter values)."""
    found = event.debezium
    if found is None:
        return _native_record(event, subscriber)
    _check(event, found)
    converters: dict[str, Any] = found["converters"]
    key = _key(found.get("key"), converters["key"])
    if converters["value"] == "avro":
        value = _avro_value(event, found, subscriber, registry)
    else:
        value = _value(event, found, converters)
    headers = _headers(found)
    size = len(key or b"") + len(value or b"") + sum(len(n) + len(v or b"") for n, v in headers)
    return KafkaRecord(
        found["topic"],
        key,
        value,
        headers,
        size,
        routed=True,  # the row's own fields name the topic (route.by.field)
        timestamp_ms=_timestamp(event, found.get("timestamp")),
        message_id=str(event.message_id),
        partition=_partition(event, found),
    )


def _native_record(event: OutboxEvent, subscriber: Subscribed) -> KafkaRecord:
    """A row written through the relay's own API: as the router would publish it from a
    table of the same columns (key aggregate_id, value the payload, header id)."""
    key = event.aggregate_id.encode()
    value = json.dumps(event.payload, separators=(",", ":"), ensure_ascii=False).encode()
    message_id = str(event.message_id).encode()
    headers: list[Header] = [(HEADER_ID, message_id)]
    size = len(key) + len(value) + len(HEADER_ID) + len(message_id)
    return KafkaRecord(
        subscriber.topic_for(event), key, value, headers, size, bool(subscriber.free_fields)
    )


def _check(event: OutboxEvent, found: dict[str, Any]) -> None:
    """Refuse what the Event Router would stop on, saying why."""
    where = f"event {event.message_id} (id {json.dumps(found.get('id'))})"
    if found.get("error"):
        raise EncodingError(f"{where}: {found['error']}")
    if found.get("missing"):
        raise EncodingError(
            f"{where}: the outbox table has no column(s) {found['missing']} (renamed or "
            "dropped after attach?); run `outbox-relay debezium attach` again with their names"
        )
    if not isinstance(found.get("route"), str):
        raise EncodingError(
            f"{where}: route.by.field is {json.dumps(found.get('route'))}, not a string: "
            "Debezium cannot route this row either"
        )
    topic = found.get("topic")
    if not isinstance(topic, str) or not _TOPIC.match(topic):
        raise EncodingError(
            f"{where}: routed to {topic!r}, which is not a legal Kafka topic name "
            "(1-249 of [a-zA-Z0-9._-])"
        )


# -- key ---------------------------------------------------------------------------------


def _key(key: Any, converter: str) -> bytes | None:
    if key is None:
        return b"null" if converter == "json" else None
    if converter == "json":
        return _json(key)
    return _java_string(key).encode()


def _java_string(value: Any) -> str:
    """What StringConverter writes: the value's toString()."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def _json(value: Any) -> bytes:
    """Compact JSON, as Kafka Connect's JsonConverter (through Jackson) writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


# -- value -------------------------------------------------------------------------------


def _value(event: OutboxEvent, found: dict[str, Any], converters: dict[str, Any]) -> bytes | None:
    text: str | None = found.get("payload")
    bytea = found.get("payload_kind") == "bytea"
    if converters["tombstone"] and (text is None or (not bytea and not text.strip(_JAVA_BLANK))):
        return None
    payload, expanded = _payload(event, text, bytea, converters["expand"])
    envelope = found.get("envelope") or []
    if converters["value"] == "json":
        if envelope:
            fields = OrderedDict([("payload", payload)])
            fields.update((alias, value) for alias, value in envelope)
            return _json(fields)
        return _json(payload)
    if envelope or expanded or bytea:
        what = "an envelope" if envelope else "an expanded payload" if expanded else "bytes"
        raise EncodingError(
            f"event {event.message_id}: StringConverter would write {what} as Java's "
            "toString(); use value.converter=JsonConverter (schemas.enable=false)"
        )
    return None if text is None else text.encode()


def _avro_value(
    event: OutboxEvent,
    found: dict[str, Any],
    subscriber: Subscribed,
    registry: RegistryFraming | None,
) -> bytes | None:
    """What AvroConverter writes: null for a null payload (or a tombstone), else the
    payload under the schema ``attach`` recorded, framed with the id the registry gives
    that schema under ``<topic>-value`` (the converter's TopicIdStrategy)."""
    text: str | None = found.get("payload")
    bytea = found.get("payload_kind") == "bytea"
    if text is None or (
        found["converters"]["tombstone"] and not bytea and not text.strip(_JAVA_BLANK)
    ):
        return None
    if registry is None:
        # The relay's configuration, never the row's fault: no dead letter.
        raise ConfigError(
            f"subscriber {subscriber.name!r}: event {event.message_id} was attached with "
            "value.converter=AvroConverter, but this relay has no schema registry "
            "(schema_registry_url, RELAY_SCHEMA_REGISTRY_URL): configure it, then "
            f"`outbox-relay subscribers resume {subscriber.name}`"
        )
    schema_text: str = found["converters"]["value_schema"]
    value = _bytea(event, text) if bytea else text
    body = io.BytesIO()
    fastavro.schemaless_writer(body, _parsed_avro(schema_text), value)
    return registry(f"{found['topic']}-value", schema_text, body.getvalue())


def _bytea(event: OutboxEvent, text: str) -> bytes:
    """A bytea payload's bytes (the copy holds Postgres's hex output, ``\\x...``)."""
    try:
        return bytes.fromhex(text.removeprefix("\\x"))
    except ValueError as exc:
        raise EncodingError(f"event {event.message_id}: unreadable bytea payload") from exc


@functools.lru_cache(maxsize=64)
def _parsed_avro(text: str) -> Any:
    """A recorded value schema, parsed once (a handful of distinct ones exist)."""
    return fastavro.parse_schema(json.loads(text))


def _payload(event: OutboxEvent, text: str | None, bytea: bool, expand: bool) -> tuple[Any, bool]:
    """The payload as a Connect value, and whether expand.json.payload turned it into a
    structure (the router expands text that starts with { or [ and parses)."""
    if text is None:
        return None, False
    if bytea:
        return base64.b64encode(_bytea(event, text)).decode(), False
    if expand and text.startswith(("{", "[")):
        try:
            return json.loads(text, object_pairs_hook=OrderedDict), True
        except ValueError:
            return text, False  # the router logs a warning and keeps the string
    return text, False


# -- headers and timestamp ---------------------------------------------------------------


def _headers(found: dict[str, Any]) -> list[Header]:
    converters = found["converters"]
    fields = [(HEADER_ID, found.get("id")), *(found.get("headers") or [])]
    # A header field under a name the relay writes is dropped (attach refuses such
    # aliases; this also covers copies made before it did).
    kept = [i for i, (name, _) in enumerate(fields) if i == 0 or not reserved_header(name)]
    values: list[bytes | None]
    if converters.get("header") == "json-schema":
        schemas = converters["header_schemas"]
        values = [
            b'{"schema":%s,"payload":%s}' % (schemas[i].encode(), _json(fields[i][1])) for i in kept
        ]
    elif converters.get("header") == "json":
        values = [_json(fields[i][1]) for i in kept]
    else:  # SimpleHeaderConverter: text as is, null as no value
        values = [
            None if fields[i][1] is None else _java_string(fields[i][1]).encode() for i in kept
        ]
    headers: list[Header] = [(fields[i][0], value) for i, value in zip(kept, values, strict=True)]
    headers += [h for h in _trace_headers(found.get("trace")) if not reserved_header(h[0])]
    return headers


def reserved_header(name: str) -> bool:
    """A name the relay writes itself in this format (``id``, and the ``outbox.`` headers
    of dead letters): a row's own header of that name is dropped, as in the plain
    formats, so none can pass for the relay's."""
    return name == HEADER_ID or name.startswith(RESERVED_HEADER_PREFIX)


def _trace_headers(context: str | None) -> list[Header]:
    """tracingspancontext holds the span context in Java properties form
    (``traceparent=00-...``, as Debezium's tracing writes it): each entry is a header."""
    if not context:
        return []
    entries = (_PROPERTY.match(line) for line in context.splitlines())
    return [(m[1], m[2].strip().encode()) for m in entries if m]


def _partition(event: OutboxEvent, found: dict[str, Any]) -> int | None:
    """The ``partition`` placement: the column's value as the router reads it (an int32;
    NULL: the partitioner decides). Anything else stops the router: this row's poison."""
    if "partition" not in found:
        return None
    value = found["partition"]
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= 2**31 - 1:
        raise EncodingError(
            f"event {event.message_id}: its partition placement holds {json.dumps(value)}, "
            "not a partition number (an integer column, 0 or more)"
        )
    return value


def _timestamp(event: OutboxEvent, value: Any) -> int | None:
    """table.field.event.timestamp: a `timestamp` column, in milliseconds as the router
    reads it (micro- to milliseconds truncated toward zero); None: the producer's clock."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value).replace(tzinfo=UTC)
    except (TypeError, ValueError) as exc:
        raise EncodingError(
            f"event {event.message_id}: table.field.event.timestamp {value!r} is not a "
            "finite timestamp"
        ) from exc
    delta = moment - _EPOCH
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return -(-micros // 1000) if micros < 0 else micros // 1000


def _records(encoders: Encoders, subscriber: Subscribed) -> RecordWriter:
    registry = encoders.schema_registry
    framing = None if registry is None else registry.frame_text

    def record(event: OutboxEvent) -> KafkaRecord:
        return debezium_record(event, subscriber, framing)

    return record


FORMAT = Format(
    records=_records,
    fixed_routing=(
        "the debezium format takes its key, partition and placements from `outbox-relay "
        "debezium attach` (table.field.event.key, table.fields.additional.placement), not "
        "from key/partition_by/placements"
    ),
    relay_headers=False,
)
