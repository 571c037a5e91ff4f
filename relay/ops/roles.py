"""Least-privilege roles for the relay and for applications that write events."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.migrations import pending
from relay.adapters.postgres.queries import parse_named, read_sql
from relay.errors import NotMigratedError

_ROLE_EXISTS = "SELECT 1 FROM pg_roles WHERE rolname = %s"


def grant_roles(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    relay_role: str | None = None,
    writer_role: str | None = None,
    create: bool = False,
    read_all_stats: bool = False,
    connection_limit: int | None = None,
) -> list[str]:
    """Apply ``relay/adapters/postgres/sql/roles.sql`` for the given roles; returns what was granted.

    ``read_all_stats`` also gives the relay role ``pg_read_all_stats`` (to name the
    sessions holding publication back; it shows every session's query text too);
    without it, the relay role is left without that role. ``connection_limit`` caps the
    relay role's backends on the database side (``CONNECTION LIMIT``; -1: no cap): the
    relays' budget, replicas x workers x max_db_connections (deploy/README.md)."""
    blocks = parse_named(read_sql("roles.sql"))
    done = []
    waiting = pending(conn, schema)
    if waiting:  # the grants name what the migrations create
        raise NotMigratedError(
            f"schema {schema!r} lacks migration(s) "
            f"{', '.join(f'{m.version:04d}_{m.name}' for m in waiting)}: "
            "run `outbox-relay migrate` first"
        )
    with wrap_errors(), conn.transaction():
        for role, names in (
            (relay_role, ["relay_grants", _stats_block(read_all_stats)]),
            (writer_role, ["writer_grants"]),
        ):
            if role is None:
                continue
            if create and conn.execute(_ROLE_EXISTS, (role,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            for name in names:
                # One block of statements; without parameters psycopg sends it as is.
                conn.execute(
                    sql.SQL(blocks[name]).format(
                        schema=sql.Identifier(schema), role=sql.Identifier(role)
                    )
                )
            done.append(f"{names[0].split('_')[0]} role {role}")
        if relay_role is not None and connection_limit is not None:
            conn.execute(
                sql.SQL("ALTER ROLE {} CONNECTION LIMIT {}").format(
                    sql.Identifier(relay_role), sql.Literal(connection_limit)
                )
            )
            done.append(f"connection limit {connection_limit} to {relay_role}")
    if relay_role is not None and read_all_stats:
        done.append(f"pg_read_all_stats to {relay_role}")
    return done


def _stats_block(read_all_stats: bool) -> str:
    return "relay_read_all_stats" if read_all_stats else "relay_no_read_all_stats"
