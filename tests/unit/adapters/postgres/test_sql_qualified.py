"""The project's SQL qualifies every call of a built-in with ``pg_catalog.`` and types
the arguments of its own functions exactly (docs/design.md §2, "Names"): some of
it runs in sessions whose ``search_path`` the relay does not own (the write API, the
triggers, a pooled backend), where a role that may CREATE in a schema on that path could
otherwise put a better-matching overload in front of it (issue #47, CVE-2018-1058).

A scan, not a parser: comments and string literals are dropped, then every
``name(`` not preceded by a dot must be SQL syntax (a keyword, or one of the forms
Postgres does not let one qualify: coalesce, greatest, least, nullif, extract...)."""

from __future__ import annotations

import re
from importlib import import_module
from pathlib import Path

import pytest

SQL_DIR = Path(__file__).resolve().parents[4] / "relay" / "adapters" / "postgres" / "sql"
# Migrations before 0014 ran as they were written; 0014 rebuilt what they left bound, and
# every migration runs with the search_path pinned (relay/adapters/postgres/migrations.py).
FIRST_QUALIFIED_MIGRATION = 14

# SQL statements kept in Python, each ``module:attribute``.
INLINE = (
    "relay.write.outbox:_STREAM_INSERT",
    "relay.adapters.postgres.pool:_FREE_SLOTS",
    "relay.adapters.postgres.migrations:_LEDGER",
    "relay.ops.roles:_ROLE_EXISTS",
    "relay.ops.roles:_READS_ALL_STATS",
    "spark_jobs.postgres_sink:MARKERS_DDL",
    "spark_jobs.postgres_sink:OWNERS_DDL",
    "spark_jobs.postgres_sink:PIN_SEARCH_PATH",
    "spark_jobs.order_projection:ORDERS_DDL",
    "spark_jobs.order_projection:UPSERT",
    "spark_jobs.window_average:COUNTERS_DDL",
)

# Words followed by "(" that are syntax, not calls. The syntax forms among them
# (coalesce, greatest, least, nullif, extract, position, substring...) are resolved in
# pg_catalog whatever the path says; OPERATOR(pg_catalog.=) names an operator in full.
SYNTAX = frozenset(
    (
        "all", "and", "any", "array", "as", "atomic", "between", "by", "cast", "check",
        "coalesce", "conflict", "do", "else", "exists", "extract", "filter", "from", "greatest",
        "grouping", "if", "in", "insert", "into", "join", "key", "lateral", "least", "like",
        "limit", "materialized", "not", "nullif", "on", "operator", "or", "over", "primary",
        "references", "return", "returning", "returns", "row", "rows", "select", "set", "some",
        "table",
        "then", "union", "unique", "update", "using", "values", "when", "where", "window",
        "with", "within",
    )
)  # fmt: skip

_COMMENT = re.compile(r"--[^\n]*")
_LITERAL = re.compile(r"'(?:[^']|'')*'")
_QUOTED = re.compile(r'"(?:[^"]|"")*"')
_CALL = re.compile(r"(?<![\w.$%])([A-Za-z_][A-Za-z0-9_]*)\s*\(")
# A relation and its columns: an alias (``AS e(version, ...)``), a table created, filled,
# indexed or referenced (``INTO orders (...)``).
_ALIAS = re.compile(r"\b(AS|TABLE|EXISTS|INTO|REFERENCES)\s+$", re.IGNORECASE)
# A call of the project's own functions: {schema}.name( ... ).
_OWN_CALL = re.compile(r"\{schema\}\.(\w+)\(")
_PARAM = re.compile(r"%\((\w+)\)s(?!::)")


def _code(text: str) -> str:
    """``text`` without comments, string literals and quoted identifiers (each replaced
    by a placeholder of no letters, so positions of the rest stay meaningful)."""
    text = _LITERAL.sub("''", _COMMENT.sub("", text))
    return _QUOTED.sub('""', text)


def unqualified_calls(text: str) -> list[str]:
    """The names called without a schema in ``text`` that are not SQL syntax."""
    code = _code(text)
    found = []
    for match in _CALL.finditer(code):
        name = match[1]
        if name.lower() in SYNTAX or _ALIAS.search(code[: match.start()]):
            continue
        found.append(name)
    return found


def untyped_own_arguments(text: str) -> list[str]:
    """Bind parameters passed to the project's own functions without a cast: their type
    would be the driver's guess (a small int goes as smallint), and an overload of that
    type in the relay's schema would be a better match."""
    code = _code(text)
    found = []
    for match in _OWN_CALL.finditer(code):
        depth, end = 1, match.end()
        while depth and end < len(code):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        found += [f"{match[1]}: %({p})s" for p in _PARAM.findall(code[match.end() : end])]
    return found


def _sql_files() -> list[Path]:
    files = sorted(SQL_DIR.glob("*.sql"))
    for path in sorted((SQL_DIR / "migrations").glob("*.sql")):
        if int(path.name[:4]) >= FIRST_QUALIFIED_MIGRATION:
            files.append(path)
    return files


def _inline(ref: str) -> str:
    module, attribute = ref.split(":")
    value = getattr(import_module(module), attribute)
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.mark.parametrize("path", _sql_files(), ids=lambda p: p.name)
def test_sql_files_qualify_every_builtin_call(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert unqualified_calls(text) == [], f"qualify them with pg_catalog. in {path.name}"
    assert untyped_own_arguments(text) == [], f"cast them to the parameter's type in {path.name}"


@pytest.mark.parametrize("ref", INLINE)
def test_inline_sql_qualifies_every_builtin_call(ref: str) -> None:
    assert unqualified_calls(_inline(ref)) == []


def test_the_scan_finds_what_it_is_for() -> None:
    """The scan itself: it flags an unqualified call, in a function body too, and
    nothing that is syntax, a comment, a string or a qualified call."""
    flagged = """
        SELECT convert_to(payload::text, 'UTF8'), pg_catalog.left(x, 2), coalesce(a, b)
          FROM {schema}.outbox o, unnest(%(ids)s::uuid[]) AS e(id, n)
         WHERE {schema}.outbox_part(o.aggregate_id, %(parts)s) = 1  -- now() in a comment
           AND x IN (SELECT 'format(' || y);
        CREATE FUNCTION {schema}.f() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM currval('s'); END $$;
    """
    assert unqualified_calls(flagged) == ["convert_to", "unnest", "currval"]
    assert untyped_own_arguments(flagged) == ["outbox_part: %(parts)s"]
    assert untyped_own_arguments("{schema}.outbox_part(a, %(parts)s::integer)") == []
