"""Schemas every role may create objects in, where the owner's commands would meet them.

Postgres before 15 (and every cluster pg_upgraded from one) lets PUBLIC CREATE in the
`public` schema. The relay pins its own connections' search_path and qualifies its
calls (docs/design.md §2, "Names"), so a function some role puts there never runs in its
queries. What remains is said by ``migrate`` and ``grant``, which the owner runs:

- PUBLIC may CREATE in the relay's own schema: refused unless the operator allows it.
  There a role with no grant can create, before a migration does, the objects it
  creates (the ledger, a table, a function a later version adds), and own what the
  owner's migrations and the relay then use: their triggers and functions would run as
  the owner or the relay. Nothing in the relay can guard against that.
- PUBLIC may CREATE in another schema on the owner's own search_path: a warning. The
  relay never resolves a name there, but the owner's other sessions (psql) and the
  applications whose path lists it may.

The fix for both is the one Postgres 15 applies to new clusters:
``REVOKE CREATE ON SCHEMA public FROM PUBLIC``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import psycopg
from psycopg import sql

from relay.adapters.postgres.db import role_schemas, wrap_errors
from relay.adapters.postgres.queries import queries_for
from relay.core.log_fields import log_extra
from relay.errors import SchemaOpenToPublic

logger = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-public-create"


def schemas_open_to_public(conn: psycopg.Connection[Any], schema: str) -> tuple[bool, list[str]]:
    """Whether PUBLIC may CREATE in ``schema``, and the other schemas of the connecting
    role's own search_path where it may."""
    path = role_schemas(conn)
    with wrap_errors():
        rows = conn.execute(
            queries_for(schema)["schemas_public_may_create_in"], {"schema": schema, "path": path}
        ).fetchall()
    return any(own for _, own in rows), [name for name, own in rows if not own]


def check_public_create(
    conn: psycopg.Connection[Any], schema: str, *, allow: bool, command: str
) -> None:
    """Warn about each schema on the role's path that PUBLIC may CREATE in; refuse
    (:class:`SchemaOpenToPublic`) when the relay's ``schema`` is one, unless ``allow``."""
    own, others = schemas_open_to_public(conn, schema)
    for name in others:
        logger.warning(
            "every role may CREATE in schema %s, which is on this role's search_path: the "
            "relay never resolves a name there, but your other sessions may; %s",
            name,
            revoke(name),
            extra=log_extra("schema_open_to_public", schema=name, command=command),
        )
    if not own:
        return
    problem = (
        f"every role may CREATE in schema {schema!r}, the relay's own: a role with no grant "
        "can create there the objects the owner's migrations and the relay then use, and run "
        f"its code as them; {revoke(schema)}"
    )
    if not allow:
        raise SchemaOpenToPublic(
            f"{command} refused: {problem} (or run {command} {ALLOW_FLAG} to accept the risk)"
        )
    logger.warning(
        "%s (allowed by %s)",
        problem,
        ALLOW_FLAG,
        extra=log_extra("schema_open_to_public", schema=schema, command=command),
    )


def revoke(schema: str) -> str:
    """The statement that closes ``schema`` to PUBLIC, as the fix to print."""
    return f"run, as its owner: REVOKE CREATE ON SCHEMA {_quoted(schema)} FROM PUBLIC"


def _quoted(name: str) -> str:
    plain = re.fullmatch(r"[a-z_][a-z0-9_]*", name) is not None
    return name if plain else sql.Identifier(name).as_string(None)
