"""Named SQL queries, loaded from ``relay/adapters/postgres/sql/queries.sql`` and
``interventions.sql`` (the operators' interventions).

Queries are written with a ``{schema}`` placeholder; :func:`queries_for` fills it
with a quoted :class:`psycopg.sql.Identifier`, so a configured schema name can never
inject SQL.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

_NAME_LINE = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)


def read_sql(resource: str) -> str:
    """The text of a file under ``relay/adapters/postgres/sql``."""
    return (
        resources.files("relay.adapters.postgres")
        .joinpath("sql", resource)
        .read_text(encoding="utf-8")
    )


def parse_named(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into ``{name: sql}``."""
    parts = _NAME_LINE.split(text)
    named: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in named:
            raise ValueError(f"query {name!r} is defined twice")
        named[name] = body.strip()
    return named


def with_schema(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


@functools.cache
def queries_for(schema: str) -> dict[str, bytes]:
    """Every named query, bound to ``schema`` and rendered once: composing a query
    costs more than some of them take to run (the write API's insert)."""
    text = "\n".join(read_sql(f) for f in ("queries.sql", "interventions.sql"))
    return {
        name: with_schema(body, schema).as_bytes(None) for name, body in parse_named(text).items()
    }
