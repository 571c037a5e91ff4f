"""Debezium Outbox Event Router compatibility: read a Debezium-style outbox table.

The relay's guarantees rest on each row's writer transaction id, which a Debezium table
(``id``, ``aggregatetype``, ``aggregateid``, ``type``, ``payload``) does not carry. So
``attach`` adds a trigger that copies every insert into the relay's outbox, inside the
writer's transaction: apps keep writing exactly what they wrote for Debezium, and the
records come out with the Event Router's key (``aggregateid``), topic
(``outbox.event.<aggregatetype>``) and ``id`` header.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from relay.db import wrap_errors
from relay.queries import parse_named, read_sql


def attach(conn: psycopg.Connection[Any], schema: str, table: str) -> str:
    """Copy inserts into ``table`` (``name`` or ``schema.name``) to the relay's outbox."""
    source_schema, _, name = table.rpartition(".")
    source = sql.Identifier(source_schema, name) if source_schema else sql.Identifier(name)
    suffix = f"{source_schema}_{name}" if source_schema else name
    statement = sql.SQL(parse_named(read_sql("debezium.sql"))["attach"]).format(
        schema=sql.Identifier(schema),
        source=source,
        function=sql.Identifier(f"outbox_from_debezium_{suffix}"[:63]),
        trigger=sql.Identifier(f"outbox_relay_copy_{suffix}"[:63]),
    )
    with wrap_errors(), conn.transaction():
        conn.execute(statement)
    return suffix
