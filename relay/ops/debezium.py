"""Debezium Outbox Event Router compatibility: read a Debezium-style outbox table.

The relay's guarantees rest on each row's ordering key, which a Debezium table (``id``,
``aggregatetype``, ``aggregateid``, ``type``, ``payload``, ...) does not carry. So
``attach`` adds a trigger that copies every insert into the relay's outbox, inside the
writer's transaction: apps keep writing exactly what they wrote for Debezium. The copy
records what the Event Router would publish for the row (relay/core/formats/debezium.py
renders it under the ``debezium`` value format); the router's options are taken by their
Debezium names, so a connector's configuration carries over as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import psycopg
from psycopg import sql

from relay.adapters.postgres.db import role_search_path, wrap_errors
from relay.adapters.postgres.queries import parse_named, read_sql
from relay.core.formats.debezium import reserved_header
from relay.core.log_fields import log_extra
from relay.errors import ConfigError, UndefinedTableError

logger = logging.getLogger(__name__)

DEFAULT_REPLACEMENT = "outbox.event.${routedByValue}"
DEFAULT_REGEX = "(?<routedByValue>.*)"
STRING_CONVERTER = "org.apache.kafka.connect.storage.StringConverter"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
SIMPLE_HEADER_CONVERTER = "org.apache.kafka.connect.storage.SimpleHeaderConverter"
# Apicurio's Avro converter (Debezium Server's debezium.format.value=avro): values in the
# Confluent wire format, with ids from a schema registry (values only).
APICURIO_AVRO_CONVERTER = "io.apicurio.registry.utils.converter.AvroConverter"
_APICURIO = "apicurio.registry."
_CONVERTERS = {
    STRING_CONVERTER: "string",
    JSON_CONVERTER: "json",
    "StringConverter": "string",
    "JsonConverter": "json",
    APICURIO_AVRO_CONVERTER: "avro",
}
# A connector's settings name the transform (transforms.outbox.route.by.field): the part
# after "transforms.<name>." is the router's option.
_TRANSFORM_PREFIX = "transforms."


class Placement(StrEnum):
    HEADER = "header"
    ENVELOPE = "envelope"
    # The column's value (an integer column, as the router reads it with getInt32) is
    # the record's partition; a NULL leaves it to the partitioner. Kafka Connect honours
    # it; Debezium Server's Kafka sink does not (it produces with no partition).
    PARTITION = "partition"


class InvalidOpBehavior(StrEnum):
    """table.op.invalid.behavior: what an UPDATE of the outbox table does."""

    WARN = "warn"  # Debezium skips it with a warning; the relay never sees it
    ERROR = "error"  # likewise, logged as an error by Debezium
    FATAL = "fatal"  # Debezium stops; the relay stops the subscriber (poison policy)


@dataclass(frozen=True)
class AdditionalField:
    column: str
    placement: Placement
    alias: str


@dataclass(frozen=True)
class RouterOptions:
    """The Event Router options ``attach`` honours, by their Debezium meaning."""

    event_id: str = "id"
    event_key: str = "aggregateid"
    event_type: str = "type"
    payload: str = "payload"
    timestamp: str | None = None
    route_by: str = "aggregatetype"
    replacement: str = DEFAULT_REPLACEMENT
    additional: tuple[AdditionalField, ...] = ()
    tombstone_on_empty_payload: bool = False
    invalid_op: InvalidOpBehavior = InvalidOpBehavior.WARN
    expand_json_payload: bool = False
    tracing_field: str = "tracingspancontext"
    key_converter: str = "string"
    value_converter: str = "string"
    header_converter: str = "simple"

    def required_columns(self) -> list[str]:
        """Columns without which the Event Router fails on a row."""
        needed = [self.event_id, self.payload, self.route_by]
        if self.timestamp:
            needed.append(self.timestamp)
        needed += [f.column for f in self.additional]
        return list(dict.fromkeys(needed))

    def trigger_argument(
        self, payload_kind: str, header_schemas: list[str] | None, value_schema: str | None = None
    ) -> str:
        """What the trigger is given (relay/adapters/postgres/sql/debezium.sql reads these names)."""
        return json.dumps(
            {
                "id": self.event_id,
                "key": self.event_key,
                "type": self.event_type,
                "payload": self.payload,
                "payload_kind": payload_kind,
                "timestamp": self.timestamp,
                "route": self.route_by,
                "replacement": self.replacement,
                "tracing": self.tracing_field,
                "headers": [
                    [f.column, f.alias] for f in self.additional if f.placement == "header"
                ],
                "envelope": [
                    [f.column, f.alias] for f in self.additional if f.placement == "envelope"
                ],
                "partition": next(
                    (f.column for f in self.additional if f.placement == "partition"), None
                ),
                "required": self.required_columns(),
                "converters": {
                    "key": self.key_converter,
                    "value": self.value_converter,
                    "header": self.header_converter,
                    # JsonConverter with schemas: each header's Connect schema, id first.
                    "header_schemas": header_schemas,
                    # AvroConverter: the value's Avro schema, as the converter registers it.
                    "value_schema": value_schema,
                    "expand": self.expand_json_payload,
                    "tombstone": self.tombstone_on_empty_payload,
                },
            },
            separators=(",", ":"),
        )


def parse_options(pairs: Iterable[str]) -> RouterOptions:
    """Options given as ``NAME=VALUE`` with Debezium's names, e.g.
    ``route.by.field=aggregate_type`` or ``transforms.outbox.table.field.event.id=uid``."""
    values: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"option {pair!r}: expected NAME=VALUE")
        values[_option_name(name.strip())] = value.strip()
    return options_from(values)


def _option_name(name: str) -> str:
    if name.startswith(_TRANSFORM_PREFIX):
        return name.split(".", 2)[2] if name.count(".") >= 2 else name
    return name


def options_from(values: Mapping[str, str]) -> RouterOptions:
    remaining = dict(values)

    def take(name: str, default: str | None = None) -> str | None:
        return remaining.pop(name, default)

    regex = take("route.topic.regex", DEFAULT_REGEX)
    if regex != DEFAULT_REGEX:
        raise ConfigError(
            f"route.topic.regex={regex!r} is not supported: the relay routes with "
            f"{DEFAULT_REGEX} (Debezium's default); use route.topic.replacement"
        )
    options = RouterOptions(
        event_id=_column(take("table.field.event.id", "id")),
        event_key=_column(take("table.field.event.key", "aggregateid")),
        event_type=_column(take("table.field.event.type", "type")),
        payload=_column(take("table.field.event.payload", "payload")),
        timestamp=take("table.field.event.timestamp") or None,
        route_by=_column(take("route.by.field", "aggregatetype")),
        replacement=take("route.topic.replacement", DEFAULT_REPLACEMENT) or DEFAULT_REPLACEMENT,
        additional=_placements(take("table.fields.additional.placement", "") or ""),
        tombstone_on_empty_payload=_boolean(
            "route.tombstone.on.empty.payload", take("route.tombstone.on.empty.payload", "false")
        ),
        invalid_op=_invalid_op(take("table.op.invalid.behavior", "warn")),
        expand_json_payload=_boolean(
            "table.expand.json.payload", take("table.expand.json.payload", "false")
        ),
        tracing_field=_column(take("tracing.span.context.field", "tracingspancontext")),
        key_converter=_converter("key", remaining),
        value_converter=_converter("value", remaining),
        header_converter=_header_converter(remaining),
    )
    _check_avro_value(options, remaining)
    remaining.pop("type", None)  # transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
    if remaining:
        raise ConfigError(
            f"unsupported Event Router option(s) {sorted(remaining)}; see deploy/README.md, "
            "'Coming from Debezium's Outbox Event Router'"
        )
    return options


def _column(name: str | None) -> str:
    if not name:
        raise ConfigError("an Event Router column option is empty")
    return name


def _boolean(name: str, value: str | None) -> bool:
    text = (value or "").lower()
    if text not in {"true", "false"}:
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return text == "true"


def _invalid_op(value: str | None) -> InvalidOpBehavior:
    # Debezium's own spellings: warn, error, fatal (older: skip-and-warn...).
    text = (value or "").lower().removeprefix("skip-and-").removeprefix("skip_and_")
    try:
        return InvalidOpBehavior(text)
    except ValueError as exc:
        raise ConfigError(
            f"table.op.invalid.behavior must be warn, error or fatal, got {value!r}"
        ) from exc


def _placements(text: str) -> tuple[AdditionalField, ...]:
    """``column:placement[:alias],...`` as Debezium writes it."""
    found = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ConfigError(
                f"table.fields.additional.placement item {item!r}: expected column:placement[:alias]"
            )
        try:
            placement = Placement(parts[1])
        except ValueError as exc:
            raise ConfigError(
                f"table.fields.additional.placement item {item!r}: placement must be header, "
                "envelope or partition"
            ) from exc
        alias = parts[2] if len(parts) == 3 else parts[0]
        if placement is Placement.HEADER and reserved_header(alias):
            raise ConfigError(
                f"table.fields.additional.placement item {item!r}: the header name {alias!r} "
                "is the relay's own (id, outbox.*); give it another alias"
            )
        found.append(AdditionalField(parts[0], placement, alias))
    if sum(f.placement is Placement.PARTITION for f in found) > 1:
        raise ConfigError("table.fields.additional.placement: at most one partition placement")
    return tuple(found)


def _converter(which: str, remaining: dict[str, str]) -> str:
    """key.converter / value.converter: StringConverter, or JsonConverter without schemas."""
    name = remaining.pop(f"{which}.converter", STRING_CONVERTER)
    schemas = remaining.pop(f"{which}.converter.schemas.enable", "true")
    converter = _CONVERTERS.get(name)
    if converter is None or (converter == "avro" and which != "value"):
        also = f", or {APICURIO_AVRO_CONVERTER}" if which == "value" else ""
        raise ConfigError(
            f"{which}.converter={name!r} is not supported: use {STRING_CONVERTER} or "
            f"{JSON_CONVERTER} (with {which}.converter.schemas.enable=false){also}"
        )
    if converter == "json" and _boolean(f"{which}.converter.schemas.enable", schemas):
        raise ConfigError(
            f"{which}.converter: JsonConverter is supported with "
            f"{which}.converter.schemas.enable=false only"
        )
    return converter


# value.converter.apicurio.registry.* settings the relay follows, with the values it can
# match byte for byte (None: any value). The url is the converter's (Apicurio's own API);
# the relay reaches the same registry through schema_registry_url (its Confluent API).
_APICURIO_SETTINGS: dict[str, str | None] = {
    "url": None,
    "auto-register": "true",
    "use-id": "contentId",
    "id-handler": "io.apicurio.registry.serde.Default4ByteIdHandler",
    "artifact-resolver-strategy": "io.apicurio.registry.serde.strategy.TopicIdStrategy",
}


def _check_avro_value(options: RouterOptions, remaining: dict[str, str]) -> None:
    """AvroConverter values: what the relay writes as the converter does (the payload, in
    the Confluent framing, under <topic>-value, the id the registry gives its content)."""
    prefix = f"value.converter.{_APICURIO}"
    given = {
        k.removeprefix(prefix): remaining.pop(k) for k in list(remaining) if k.startswith(prefix)
    }
    if options.value_converter != "avro":
        if given:
            raise ConfigError(f"{prefix}* settings need value.converter={APICURIO_AVRO_CONVERTER}")
        return
    if options.expand_json_payload or any(
        f.placement is Placement.ENVELOPE for f in options.additional
    ):
        raise ConfigError(
            f"value.converter={APICURIO_AVRO_CONVERTER} is supported for a payload as it is: "
            "not with table.expand.json.payload=true or an envelope placement"
        )
    if given.get("auto-register", "").lower() != "true":
        raise ConfigError(
            f"value.converter={APICURIO_AVRO_CONVERTER} is supported with "
            f"{prefix}auto-register=true (the relay registers the value schema under "
            "<topic>-value, as the converter then does)"
        )
    for name, value in given.items():
        allowed = _APICURIO_SETTINGS.get(name, "")
        if allowed is not None and value.lower() != allowed.lower():
            supported = ", ".join(f"{n}={v}" for n, v in _APICURIO_SETTINGS.items() if v)
            raise ConfigError(
                f"{prefix}{name}={value!r} is not supported: the relay writes what the "
                f"converter writes with {supported} (its defaults, auto-register aside)"
            )


def _header_converter(remaining: dict[str, str]) -> str:
    """header.converter: Kafka Connect's SimpleHeaderConverter (its default: text as is),
    or JsonConverter, with schemas (Debezium Server's default, debezium.format.header=json)
    or without (debezium.format.header.schemas.enable=false)."""
    name = remaining.pop("header.converter", SIMPLE_HEADER_CONVERTER)
    schemas = remaining.pop("header.converter.schemas.enable", "true")
    if name in (SIMPLE_HEADER_CONVERTER, "SimpleHeaderConverter"):
        return "simple"
    if _CONVERTERS.get(name) != "json":
        raise ConfigError(
            f"header.converter={name!r} is not supported: use {SIMPLE_HEADER_CONVERTER} or "
            f"{JSON_CONVERTER}"
        )
    return "json-schema" if _boolean("header.converter.schemas.enable", schemas) else "json"


# -- attach ------------------------------------------------------------------------------


def attach(
    conn: psycopg.Connection[Any],
    schema: str,
    table: str,
    options: RouterOptions | None = None,
    *,
    cut_over_publication: str | None = None,
) -> str | None:
    """Copy inserts into ``table`` (``name`` or ``schema.name``) to the relay's outbox.

    With ``cut_over_publication`` (a running Debezium's publication), the same transaction
    takes the table out of it; returns the WAL position of the switch: once Debezium's
    slot has confirmed it, Debezium has published everything that is not the relay's.
    """
    options = options or RouterOptions()
    queries = parse_named(read_sql("debezium.sql"))
    source = _source(conn, table)
    names = _names(conn, schema, table, source)
    with wrap_errors(), conn.transaction():
        kind, schemas, value_schema = _inspect(conn, source, options)
        if cut_over_publication is not None:
            _leave_publication(conn, queries, names, source, cut_over_publication)
        names["options"] = sql.Literal(options.trigger_argument(kind, schemas, value_schema))
        for query in ("register", "attach", "drop_old_function"):
            conn.execute(sql.SQL(queries[query]).format(**names))
        if options.invalid_op is InvalidOpBehavior.FATAL:
            conn.execute(sql.SQL(queries["attach_fatal_updates"]).format(**names))
    logger.info(
        "attached %s (payload %s, options %s)",
        table,
        kind,
        options,
        extra=log_extra("debezium_table_attached", table=table, payload=kind),
    )
    if cut_over_publication is None:
        return None
    with wrap_errors():
        row = conn.execute(queries["wal_position"]).fetchone()
    return str(row[0]) if row else None


def detach(conn: psycopg.Connection[Any], schema: str, table: str) -> None:
    """Stop copying inserts into ``table`` to the relay's outbox (what is copied stays)."""
    queries = parse_named(read_sql("debezium.sql"))
    names = _names(conn, schema, table, _source(conn, table))
    try:
        with wrap_errors(), conn.transaction():
            conn.execute(sql.SQL(queries["detach"]).format(**names))
    except UndefinedTableError as exc:
        raise ConfigError(f"table {table} does not exist") from exc
    logger.info("detached %s", table, extra=log_extra("debezium_table_detached", table=table))


def _source(conn: psycopg.Connection[Any], table: str) -> sql.Identifier:
    """The table ``table`` names (``name`` or ``schema.name``), with its schema."""
    source_schema, _, name = table.rpartition(".")
    source_schema = source_schema or _schema_of(conn, name)
    return sql.Identifier(source_schema, name) if source_schema else sql.Identifier(name)


def _schema_of(conn: psycopg.Connection[Any], name: str) -> str:
    """The schema in which the connecting role's own search_path finds table ``name``
    (the relay's connections resolve nothing outside pg_catalog: db.configure), as psql
    would; "" when it finds none (then the name, unqualified, fails as missing)."""
    query = parse_named(read_sql("debezium.sql"))["schema_of"]
    with role_search_path(conn):
        row = conn.execute(query, {"table": sql.Identifier(name).as_string(conn)}).fetchone()
    return str(row[0]) if row else ""


def _names(
    conn: psycopg.Connection[Any], schema: str, table: str, source: sql.Identifier
) -> dict[str, sql.Composable]:
    """What relay/adapters/postgres/sql/debezium.sql names: the table (``source``), its
    triggers (named after ``table`` as the operator gave it), the relay's schema."""
    source_schema, _, name = table.rpartition(".")
    suffix = f"{source_schema}_{name}" if source_schema else name
    return {
        "schema": sql.Identifier(schema),
        "source": source,
        "source_name": sql.Literal(source.as_string(conn)),
        "trigger": sql.Identifier(f"outbox_relay_copy_{suffix}"[:63]),
        "update_trigger": sql.Identifier(f"outbox_relay_update_{suffix}"[:63]),
        "old_function": sql.Identifier(f"outbox_from_debezium_{suffix}"[:63]),
    }


def _leave_publication(
    conn: psycopg.Connection[Any],
    queries: dict[str, str],
    names: dict[str, sql.Composable],
    source: sql.Identifier,
    publication: str,
) -> None:
    table = source.as_string(conn)
    found = conn.execute(
        queries["publication"], {"table": table, "publication": publication}
    ).fetchone()
    if found is None:
        raise ConfigError(f"there is no publication {publication!r}")
    all_tables, listed = found
    if all_tables:
        raise ConfigError(
            f"publication {publication!r} is FOR ALL TABLES, so {table} cannot leave it: "
            "give Debezium a publication that lists its tables first "
            "(publication.autocreate.mode=filtered), see deploy/README.md"
        )
    if not listed:
        raise ConfigError(f"{table} is not in publication {publication!r}")
    names = {**names, "publication": sql.Identifier(publication)}
    conn.execute(sql.SQL(queries["cut_over"]).format(**names))


# Column types whose values the relay writes as Debezium does (row_to_json's JSON is
# the connector's value): ids, keys, header and envelope fields must be one of them.
# Not, for example, numeric (Debezium: scaled bytes), floats (Java's formatting) or
# timestamps (Debezium: epoch microseconds).
_RENDERED_TYPES = frozenset(
    {"text", "varchar", "bpchar", "uuid", "int2", "int4", "int8", "bool", "json", "jsonb"}
)


def _check_rendered_types(options: RouterOptions, types: dict[str, str]) -> None:
    fields = [options.event_id, *(f.column for f in options.additional)]
    if options.event_key in types:
        fields.append(options.event_key)
    odd = sorted({f"{c} ({types[c]})" for c in fields if types[c] not in _RENDERED_TYPES})
    if odd:
        raise ConfigError(
            f"column(s) {odd} are not supported as id, key, header or envelope fields: "
            f"the relay renders {sorted(_RENDERED_TYPES)} as Debezium does"
        )


def _inspect(
    conn: psycopg.Connection[Any], source: sql.Identifier, options: RouterOptions
) -> tuple[str, list[str] | None, str | None]:
    """How the payload column reads (json, jsonb, bytea or text), the headers' Connect
    schemas when the header converter writes them, and the value's Avro schema under
    AvroConverter, once the options are checked against the table: a missing column
    would fail every row in Debezium."""
    query = parse_named(read_sql("debezium.sql"))["columns"]
    try:
        with wrap_errors():
            rows = conn.execute(query, {"table": source.as_string(conn)}).fetchall()
    except UndefinedTableError as exc:
        raise ConfigError(f"table {source.as_string(conn)} does not exist") from exc
    types = {column: typname for column, _, typname in rows}
    not_null = {column for column, required, _ in rows if required}
    missing = [c for c in options.required_columns() if c not in types]
    if missing:
        raise ConfigError(
            f"table {source.as_string(conn)} has no column(s) {missing}; its columns are "
            f"{sorted(types)} (set table.field.event.* / route.by.field to their names)"
        )
    if options.timestamp and types[options.timestamp] != "timestamp":
        raise ConfigError(
            f"table.field.event.timestamp={options.timestamp} is of type "
            f"{types[options.timestamp]}: Debezium takes the record timestamp from a "
            "`timestamp` (without time zone) column only"
        )
    _check_rendered_types(options, types)
    for placed in (f for f in options.additional if f.placement is Placement.PARTITION):
        if types[placed.column] != "int4":
            raise ConfigError(
                f"table.fields.additional.placement={placed.column}:partition: the column is "
                f"of type {types[placed.column]}; the router reads a partition from an "
                "`integer` column only (it would stop on every row)"
            )
    kind = types[options.payload]
    schemas = None
    if options.header_converter == "json-schema":
        headers = [
            options.event_id,
            *(f.column for f in options.additional if f.placement == "header"),
        ]
        schemas = [_connect_schema(types[c], c in not_null) for c in headers]
    value_schema = None
    if options.value_converter == "avro":
        value_schema = _avro_value_schema(options.payload, kind, options.payload in not_null)
    return kind if kind in {"json", "jsonb", "bytea"} else "text", schemas, value_schema


# The Connect schema Debezium's PostgreSQL connector gives a column of these types.
_CONNECT_TYPES = {
    "text": ("string", None),
    "varchar": ("string", None),
    "bpchar": ("string", None),
    "uuid": ("string", "io.debezium.data.Uuid"),
    "json": ("string", "io.debezium.data.Json"),
    "jsonb": ("string", "io.debezium.data.Json"),
    "int2": ("int16", None),
    "int4": ("int32", None),
    "int8": ("int64", None),
    "bool": ("boolean", None),
}


def _connect_schema(typname: str, not_null: bool) -> str:
    """As JsonConverter writes it: type, optional, then name and version if named (as
    text: the copy is jsonb, which would reorder an object's keys)."""
    connect_type, name = _CONNECT_TYPES[typname]
    schema: dict[str, Any] = {"type": connect_type, "optional": not not_null}
    if name is not None:
        schema.update(name=name, version=1)
    return json.dumps(schema, separators=(",", ":"))


# The Avro schema Apicurio's AvroConverter writes for the payload column's Connect schema
# (as Debezium Server 3.6 registers it: compact, Connect's name and version as
# properties); a nullable column is a union with null first.
_AVRO_PAYLOADS = {
    "text": '"string"',
    "varchar": '"string"',
    "bpchar": '"string"',
    "bytea": '"bytes"',
    "json": '{"type":"string","connect.version":1,"connect.name":"io.debezium.data.Json"}',
    "jsonb": '{"type":"string","connect.version":1,"connect.name":"io.debezium.data.Json"}',
}


def _avro_value_schema(column: str, typname: str, not_null: bool) -> str:
    schema = _AVRO_PAYLOADS.get(typname)
    if schema is None:
        raise ConfigError(
            f"table.field.event.payload={column} is of type {typname}: under "
            f"{APICURIO_AVRO_CONVERTER} the relay writes payloads of types "
            f"{sorted(_AVRO_PAYLOADS)}"
        )
    return schema if not_null else f'["null",{schema}]'
