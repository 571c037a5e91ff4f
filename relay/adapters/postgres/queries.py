"""Named SQL queries, loaded from ``relay/adapters/postgres/sql/queries.sql``,
``interventions.sql`` (the operators' interventions), ``verify.sql`` (what verify
reads) and ``fetch.sql`` (the relay's fetches).

Queries are written with a ``{schema}`` placeholder; :func:`queries_for` fills it
with a quoted :class:`psycopg.sql.Identifier`, so a configured schema name can never
inject SQL. The fetches also name the fragments of ``fetch_rules.sql`` (``{row_bytes}``:
the size rule, ...), which it puts in their place: each rule is written once.
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


def _code(fragment: str) -> str:
    """A fragment without the comment that leads it: it documents the rule in the .sql
    file, and would be sent with every query that uses it."""
    lines = fragment.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines)


@functools.cache
def queries_for(schema: str) -> dict[str, bytes]:
    """Every named query, bound to ``schema`` and rendered once: composing a query
    costs more than some of them take to run (the write API's insert)."""
    # Each file parsed alone: a file's leading comment is no part of another's last query.
    named: dict[str, str] = {}
    for resource in ("queries.sql", "interventions.sql", "verify.sql", "fetch.sql"):
        for name, body in parse_named(read_sql(resource)).items():
            if named.setdefault(name, body) is not body:
                raise ValueError(f"query {name!r} is defined twice")
    fragments = {
        name: with_schema(_code(body), schema)
        for name, body in parse_named(read_sql("fetch_rules.sql")).items()
    }
    return {
        name: sql.SQL(body).format(schema=sql.Identifier(schema), **fragments).as_bytes(None)
        for name, body in named.items()
    }
