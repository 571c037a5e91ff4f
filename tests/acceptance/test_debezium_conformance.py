"""The debezium format against Debezium itself: Debezium Server (PostgreSQL connector,
pgoutput, Outbox Event Router) and the relay publish the same rows to the same Kafka;
every record must match in topic, partition, key, value and headers. Not the record
timestamp: Debezium Server's Kafka sink leaves it to the producer's clock, even with
table.field.event.timestamp (tests/acceptance/test_debezium.py checks the relay's, which
follows the router as Kafka Connect runs it).

Debezium Server is fetched through the project's pinned fetcher (relay/localstack) on
first use: about 780 MB, cached. Its ``avro`` value format (Apicurio's AvroConverter,
bundled) also needs Apache Avro, which the distribution lacks: added from its own lock.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from relay.adapters.postgres import migrations
from relay.core.model import ConsumedRecord
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack.debezium import LocalDebeziumServer, avro_converter_jars, postgres_to_kafka
from relay.localstack.postgres import LocalPostgres
from tests.acceptance.test_debezium import attach
from tests.support import consume, grant_test_roles

pytestmark = pytest.mark.debezium

TRACE = "traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# Debezium Server's context headers (__debezium.context.*, one a random run id) are off,
# as are the trace headers its no-op tracer would not write.
_NOT_COMPARED = ("traceparent",)


@dataclass(frozen=True)
class Shape:
    """A Debezium outbox table, its router options, and rows for it (SQL values)."""

    name: str
    columns: str
    options: tuple[str, ...]
    rows: tuple[str, ...]
    routes: tuple[str, ...]  # routing values the rows use (their topics are created first)


STANDARD = Shape(
    "standard",
    "id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL, aggregateid varchar(255)"
    " NOT NULL, type varchar(255) NOT NULL, payload jsonb, tracingspancontext text",
    ("table.fields.additional.placement=type:header:eventType",),
    (
        "gen_random_uuid(), 'Order', 'o-1', 'Created', '{\"total\": 12, \"lines\": [{\"sku\":"
        f' "a"}}], "paid": true}}\', \'{TRACE}\'',
        "gen_random_uuid(), 'Order', 'o-2', 'Created', '{\"total\": 3}', NULL",
        "gen_random_uuid(), 'Order', 'o-1', 'Paid', '{}', NULL",
        "gen_random_uuid(), 'Invoice', 'i-1', 'Issued', NULL, NULL",
    ),
    ("Order", "Invoice"),
)
LOOSE = Shape(
    "loose",
    "id varchar(64) PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload text",
    ("table.fields.additional.placement=type:header",),
    (
        "'evt-1', 'Order', 'o-1', 'Created', 'not json'",
        "'evt-2', 'Order', NULL, NULL, NULL",
        "'evt-3', '', 'o-3', '', '[1, 2]'",
        "'evt-4', 'Order', 'o-1', 'Noted', '   '",
    ),
    ("Order", ""),
)
RENAMED = Shape(
    "renamed",
    "uid uuid PRIMARY KEY, stream text NOT NULL, entity text, kind text, body jsonb,"
    " created timestamp, tenant text",
    (
        "table.field.event.id=uid",
        "table.field.event.key=entity",
        "table.field.event.type=kind",
        "table.field.event.payload=body",
        "table.field.event.timestamp=created",
        "route.by.field=stream",
        "route.tombstone.on.empty.payload=true",
        "table.fields.additional.placement=kind:header:eventType,tenant:header:tenant",
    ),
    (
        "gen_random_uuid(), 'Cart', 'c-1', 'Placed', '{\"n\": 1}', '2024-05-01 10:00:00.123456',"
        " 'acme'",
        "gen_random_uuid(), 'Cart', 'c-1', 'Removed', NULL, '1969-12-31 23:59:59.9995', NULL",
        "gen_random_uuid(), 'Cart', 'c-2', 'Placed', '{\"n\": 2}', NULL, 'acme'",
    ),
    ("Cart",),
)
# JSON converters only: an envelope, an expanded payload or bytes under StringConverter
# are Java toString() output, which no consumer reads (the relay refuses them).
ENVELOPE = Shape(
    "envelope",
    "id uuid PRIMARY KEY, aggregatetype text NOT NULL, aggregateid text, type text,"
    " payload json, tenant text",
    (
        "table.expand.json.payload=true",
        "table.fields.additional.placement=type:envelope:eventType,tenant:envelope,"
        "type:header:eventType",
    ),
    (
        'gen_random_uuid(), \'Ship\', \'s-1\', \'Sent\', \'{"to":"x", "items": [{"sku": "a",'
        ' "qty": 2}], "express": false}\', \'acme\'',
        "gen_random_uuid(), 'Ship', 's-1', 'Lost', '\"just text\"', NULL",
        "gen_random_uuid(), 'Ship', 's-2', 'Sent', NULL, 'acme'",
    ),
    ("Ship",),
)
BYTES = Shape(
    "bytes",
    "id bigint PRIMARY KEY, aggregatetype text NOT NULL, aggregateid bigint, type text,"
    " payload bytea",
    (),
    ("7, 'Blob', 99, 'Stored', '\\x00ff10'::bytea", "8, 'Blob', NULL, 'Stored', ''::bytea"),
    ("Blob",),
)

STRING = "org.apache.kafka.connect.storage.StringConverter"
JSON = "org.apache.kafka.connect.json.JsonConverter"


_HEADERS_SCHEMALESS = {"debezium.format.header.schemas.enable": "false"}
_HEADERS_RELAY_SCHEMALESS = (f"header.converter={JSON}", "header.converter.schemas.enable=false")


@dataclass(frozen=True)
class Setup:
    """A converter setup: Debezium Server's format settings, and the same for attach.
    Headers: Debezium Server's default (JSON with schemas) with StringConverter, JSON
    without schemas with JsonConverter."""

    name: str
    server: dict[str, str]
    relay: tuple[str, ...]
    shapes: tuple[Shape, ...]


SETUPS = [
    Setup(
        "string",
        {"debezium.format.key": "simplestring", "debezium.format.value": "simplestring"},
        (f"key.converter={STRING}", f"value.converter={STRING}", f"header.converter={JSON}"),
        (STANDARD, LOOSE, RENAMED),
    ),
    Setup(
        "json",
        {
            "debezium.format.key": "json",
            "debezium.format.value": "json",
            "debezium.format.key.schemas.enable": "false",
            "debezium.format.value.schemas.enable": "false",
            **_HEADERS_SCHEMALESS,
        },
        (
            f"key.converter={JSON}",
            "key.converter.schemas.enable=false",
            f"value.converter={JSON}",
            "value.converter.schemas.enable=false",
            *_HEADERS_RELAY_SCHEMALESS,
        ),
        (STANDARD, LOOSE, RENAMED, ENVELOPE, BYTES),
    ),
]


# A NOT NULL payload: AvroConverter's schema is then no union with null.
STRICT = Shape(
    "strict",
    "id uuid PRIMARY KEY, aggregatetype text NOT NULL, aggregateid text, type text,"
    " payload jsonb NOT NULL",
    (),
    (
        "gen_random_uuid(), 'Pay', 'p-1', 'Made', '{\"amount\": 5, \"note\": \"ok\"}'",
        "gen_random_uuid(), 'Pay', 'p-2', 'Made', '[]'",
    ),
    ("Pay",),
)
APICURIO_AVRO = "io.apicurio.registry.utils.converter.AvroConverter"
BYTE_ARRAY = "org.apache.kafka.common.serialization.ByteArraySerializer"


@pytest.fixture
def debezium_server(
    tmp_path: Path,
) -> Iterator[Callable[..., LocalDebeziumServer]]:
    started: list[LocalDebeziumServer] = []

    def start(properties: dict[str, str], extra_jars: tuple[Path, ...] = ()) -> LocalDebeziumServer:
        server = LocalDebeziumServer(
            tmp_path / f"debezium-{len(started)}", properties, extra_jars=extra_jars
        )
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


def server_properties(
    pg: LocalPostgres, dbname: str, bootstrap: str, prefix: str, shapes: tuple[Shape, ...]
) -> dict[str, str]:
    """Debezium Server: the PostgreSQL connector on ``dbname``, one Event Router per table
    (each chosen by a predicate on the table's topic), the Kafka sink."""
    props = {
        **postgres_to_kafka(pg, dbname, bootstrap),
        "debezium.source.offset.flush.interval.ms": "0",
        "debezium.source.extended.headers.enabled": "false",
        "debezium.source.table.include.list": ",".join(f"public.{s.name}" for s in shapes),
        "debezium.transforms": ",".join(s.name for s in shapes),
        "debezium.predicates": ",".join(s.name for s in shapes),
        "debezium.format.header": "json",
    }
    for shape in shapes:
        props[f"debezium.predicates.{shape.name}.type"] = (
            "org.apache.kafka.connect.transforms.predicates.TopicNameMatches"
        )
        props[f"debezium.predicates.{shape.name}.pattern"] = f"dbz.public.{shape.name}"
        transform = f"debezium.transforms.{shape.name}"
        props[f"{transform}.type"] = "io.debezium.transforms.outbox.EventRouter"
        props[f"{transform}.predicate"] = shape.name
        for option in (*shape.options, replacement(prefix)):
            name, _, value = option.partition("=")
            props[f"{transform}.{name}"] = value
    return props


def replacement(prefix: str) -> str:
    return f"route.topic.replacement={prefix}outbox.event.${{routedByValue}}"


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_the_debezium_format_is_byte_identical_to_the_outbox_event_router(
    setup: Setup,
    logical_postgres: LocalPostgres,
    kafka_bootstrap: str,
    debezium_server: Callable[..., LocalDebeziumServer],
    registry: SchemaFolder,
) -> None:
    dbname = f"conf_{setup.name}"
    tag = uuid.uuid4().hex[:8]
    ours, theirs = f"r{tag}.", f"d{tag}."
    with psycopg.connect(logical_postgres.url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {dbname}")
    url = logical_postgres.url_for(dbname)
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
        for shape in setup.shapes:
            conn.execute(f"CREATE TABLE {shape.name} ({shape.columns})")
            attach(url, shape.name, *shape.options, *setup.relay, replacement(ours))
        topics = create_topics(kafka_bootstrap, setup.shapes, (ours, theirs))
        server = debezium_server(
            {
                **server_properties(
                    logical_postgres, dbname, kafka_bootstrap, theirs, setup.shapes
                ),
                **setup.server,
            }
        )
        server.wait_streaming(url)
        relay = start_relay_on(url, kafka_bootstrap, registry, topic_allow=ours_allowed(ours))
        try:
            expected = insert_rows(conn, setup.shapes)
            seen = consume(kafka_bootstrap, topics, 2 * expected, timeout=60)
        finally:
            relay.stop()
    mine = records(seen, ours)
    debezium = records(seen, theirs)
    assert sum(map(len, debezium.values())) == expected, "Debezium Server missed rows"
    assert mine == debezium


@pytest.mark.registry
def test_avro_converter_values_are_byte_identical_to_debezium_servers(
    logical_postgres: LocalPostgres,
    kafka_bootstrap: str,
    debezium_server: Callable[..., LocalDebeziumServer],
    registry: SchemaFolder,
    schema_registry: str,
) -> None:
    """Debezium Server's ``avro`` value format (Apicurio's AvroConverter, Apicurio's own
    API) and the relay (its Confluent-compatible API), on one registry: the same value
    bytes, schema id included, for jsonb, text and bytea payloads, NULL or NOT NULL."""
    apicurio = schema_registry.removesuffix("/apis/ccompat/v7") + "/apis/registry/v2"
    shapes = (STRICT, STANDARD, LOOSE, RENAMED, BYTES)
    dbname = "conf_avro"
    tag = uuid.uuid4().hex[:8]
    ours, theirs = f"r{tag}.", f"d{tag}."
    with psycopg.connect(logical_postgres.url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {dbname}")
    url = logical_postgres.url_for(dbname)
    converter = (
        f"key.converter={STRING}",
        f"value.converter={APICURIO_AVRO}",
        f"value.converter.apicurio.registry.url={apicurio}",
        "value.converter.apicurio.registry.auto-register=true",
        f"header.converter={JSON}",
    )
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
        for shape in shapes:
            conn.execute(f"CREATE TABLE {shape.name} ({shape.columns})")
            attach(url, shape.name, *shape.options, *converter, replacement(ours))
        topics = create_topics(kafka_bootstrap, shapes, (ours, theirs))
        properties = {
            **server_properties(logical_postgres, dbname, kafka_bootstrap, theirs, shapes),
            "debezium.sink.kafka.producer.value.serializer": BYTE_ARRAY,
            "debezium.format.key": "simplestring",
            "debezium.format.value": "avro",
            "debezium.format.value.apicurio.registry.url": apicurio,
            "debezium.format.value.apicurio.registry.auto-register": "true",
        }
        server = debezium_server(properties, tuple(avro_converter_jars()))
        server.wait_streaming(url)
        relay = start_relay_on(
            url,
            kafka_bootstrap,
            registry,
            schema_registry_url=schema_registry,
            topic_allow=ours_allowed(ours),
        )
        try:
            expected = insert_rows(conn, shapes)
            seen = consume(kafka_bootstrap, topics, 2 * expected, timeout=60)
        finally:
            relay.stop()
    mine = records(seen, ours)
    debezium = records(seen, theirs)
    assert sum(map(len, debezium.values())) == expected, "Debezium Server missed rows"
    values = [v for group in debezium.values() for _, v, _ in group if v is not None]
    assert values and all(v[:1] == b"\x00" for v in values), "not the Confluent wire format"
    assert mine == debezium


def ours_allowed(prefix: str) -> str:
    """``topic_allow`` for the topics the test made before the relay started (issue #47:
    rows reach an existing topic only if the outbox made it, or the operator names it)."""
    return re.escape(prefix) + r"outbox\.event\..*"


def start_relay_on(url: str, bootstrap: str, registry: SchemaFolder, **settings: Any) -> Relay:
    """A relay on ``url`` (the owner's) with one subscriber in the debezium format, as
    the relay role."""
    relay = Relay(
        load_settings(
            database_url=grant_test_roles(url).relay_url,
            bootstrap_servers=bootstrap,
            subscribers=[{"name": "dbz", "value_format": "debezium"}],
            poll_interval=0.2,
            metrics_port=0,
            **settings,
        ),
        registry=registry,
    )
    relay.start()
    return relay


def create_topics(
    bootstrap: str, shapes: tuple[Shape, ...], prefixes: tuple[str, ...]
) -> list[str]:
    """Every routed topic, 3 partitions each on both sides (the broker creates none)."""
    names = sorted(
        {f"{p}outbox.event.{route}" for s in shapes for route in s.routes for p in prefixes}
    )
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(n, 3, 1) for n in names]).values():
        future.result()
    return names


def insert_rows(conn: psycopg.Connection[Any], shapes: tuple[Shape, ...]) -> int:
    """The rows, one transaction each, interleaved over the tables; then a transaction
    inserts and deletes its row, as many apps do, and the rows left are updated. Returns
    how many were inserted."""
    count = 0
    longest = max(len(s.rows) for s in shapes)
    for i in range(longest):
        for shape in shapes:
            if i < len(shape.rows):
                conn.execute(f"INSERT INTO {shape.name} VALUES ({shape.rows[i]})")
                count += 1
    with conn.transaction():
        conn.execute(f"INSERT INTO {shapes[0].name} VALUES ({shapes[0].rows[1]})")
        conn.execute(f"DELETE FROM {shapes[0].name}")
    for shape in shapes:  # table.op.invalid.behavior=warn: an UPDATE publishes nothing
        column = shape.columns.split()[0]
        conn.execute(f"UPDATE {shape.name} SET {column} = {column}")
    return count + 1


def records(seen: list[ConsumedRecord], prefix: str) -> dict[tuple[str, int | None], list[Any]]:
    """One side's records without its topic prefix, by topic and partition, each in its
    partition's order. Records without a key go to a partition picked at random (on both
    sides): they are compared by topic only."""
    grouped: dict[tuple[str, int | None], list[Any]] = {}
    for r in sorted(seen, key=lambda r: (r.topic, r.partition, r.offset)):
        if r.topic.startswith(prefix):
            where = (r.topic.removeprefix(prefix), r.partition if r.key is not None else None)
            headers = [h for h in r.headers if h[0] not in _NOT_COMPARED]
            grouped.setdefault(where, []).append((r.key, r.value, headers))
    for (_, partition), group in grouped.items():
        if partition is None:
            group.sort(key=repr)
    return grouped
