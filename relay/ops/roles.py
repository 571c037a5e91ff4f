"""Least-privilege roles for the relay and for applications that write events."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from relay.adapters.postgres import namespaces
from relay.adapters.postgres.db import PINNED_SEARCH_PATH, wrap_errors
from relay.adapters.postgres.migrations import pending
from relay.adapters.postgres.queries import parse_named, queries_for, read_sql
from relay.errors import ConfigError, DatabaseError, NotMigratedError

_ROLE_EXISTS = "SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %s"
# Whether the role is itself a member of pg_read_all_stats (not through another role,
# which neither GRANT nor REVOKE of it would change).
_READS_ALL_STATS = """
SELECT EXISTS (SELECT FROM pg_catalog.pg_auth_members m
                  JOIN pg_catalog.pg_roles r ON r.oid = m.member
                 WHERE m.roleid = 'pg_read_all_stats'::regrole AND r.rolname = %s)
"""
# `--aggregate-types '*'`: the writer role may write any aggregate type again.
ANY_AGGREGATE_TYPE = "*"


def grant_roles(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    relay_role: str | None = None,
    writer_role: str | None = None,
    create: bool = False,
    read_all_stats: bool = False,
    connection_limit: int | None = None,
    aggregate_types: Sequence[str] | None = None,
    allow_public_create: bool = False,
) -> list[str]:
    """Apply ``relay/adapters/postgres/sql/roles.sql`` for the given roles; returns what was granted.

    ``read_all_stats`` also gives the relay role ``pg_read_all_stats`` (to name the
    sessions holding publication back; it shows every session's query text too);
    without it, the relay role is left without that role. ``connection_limit`` caps the
    relay role's backends on the database side (``CONNECTION LIMIT``; -1: no cap): the
    relays' budget, replicas x workers x max_db_connections (deploy/README.md).
    ``aggregate_types`` restricts the writer role to inserting those aggregate types
    (``[ANY_AGGREGATE_TYPE]``: lifts that); None leaves what an earlier grant set.

    It asks for no more than the owner deploy/README.md describes has: no superuser,
    CREATEROLE only with ``create``, and the ADMIN option on pg_read_all_stats only to
    change that membership (a role whose membership is already as asked is left alone).
    A schema PUBLIC may CREATE in is refused as ``migrate`` refuses it."""
    namespaces.check_public_create(conn, schema, allow=allow_public_create, command="grant")
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
        conn.execute(
            queries_for(schema)["pin_search_path_locally"], {"search_path": PINNED_SEARCH_PATH}
        )
        for role, kind in ((relay_role, "relay"), (writer_role, "writer")):
            if role is None:
                continue
            if create and conn.execute(_ROLE_EXISTS, (role,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            _run(conn, blocks[f"{kind}_grants"], schema, role)
            if kind == "relay":
                _set_read_all_stats(conn, blocks, schema, role, read_all_stats)
            done.append(f"{kind} role {role}")
        if writer_role is not None and aggregate_types is not None:
            done.append(_restrict_types(conn, blocks, schema, writer_role, aggregate_types))
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


def _run(conn: psycopg.Connection[Any], block: str, schema: str, role: str) -> None:
    # One block of statements; without parameters psycopg sends it as is.
    conn.execute(sql.SQL(block).format(schema=sql.Identifier(schema), role=sql.Identifier(role)))


def _set_read_all_stats(
    conn: psycopg.Connection[Any], blocks: dict[str, str], schema: str, role: str, wanted: bool
) -> None:
    """Make ``role`` a member of pg_read_all_stats, or not, only if it is not already so:
    changing it takes the ADMIN option on pg_read_all_stats (CREATEROLE before Postgres
    16), which a least-privileged owner lacks."""
    row = conn.execute(_READS_ALL_STATS, (role,)).fetchone()
    if row is not None and bool(row[0]) == wanted:
        return
    block = "relay_read_all_stats" if wanted else "relay_no_read_all_stats"
    try:
        _run(conn, blocks[block], schema, role)
    except psycopg.errors.InsufficientPrivilege as exc:
        verb, statement = (
            ("grant", "GRANT pg_read_all_stats TO")
            if wanted
            else ("revoke", "REVOKE pg_read_all_stats FROM")
        )
        raise DatabaseError(
            f"this owner may not {verb} pg_read_all_stats for {role} (that takes the ADMIN "
            "option on pg_read_all_stats, or CREATEROLE before Postgres 16): ask a superuser "
            f"to run `{statement} {role}`, then run grant again",
            sqlstate=exc.sqlstate,
        ) from exc


def _restrict_types(
    conn: psycopg.Connection[Any],
    blocks: dict[str, str],
    schema: str,
    role: str,
    types: Sequence[str],
) -> str:
    """The writer role's restrictive INSERT policy, replacing any it had: so that a writer
    cannot write events of another writer's aggregates (their streams' versions, their
    topics). Row-level security is switched on at the first restriction only: it takes a
    brief exclusive lock on the outbox, and without it nothing changes for anyone."""
    if not types or (ANY_AGGREGATE_TYPE in types and len(types) > 1):
        raise ConfigError("aggregate_types: name the types, or '*' alone for any")
    names = {"schema": sql.Identifier(schema), "role": sql.Identifier(role)}
    policies = conn.execute(blocks["writer_types_policies"], {"schema": schema, "role": role})
    for (policy,) in policies.fetchall():
        conn.execute(sql.SQL(blocks["drop_policy"]).format(policy=sql.Identifier(policy), **names))
    if list(types) == [ANY_AGGREGATE_TYPE]:
        return f"any aggregate type to {role}"
    state = conn.execute(blocks["row_security_state"], {"schema": schema}).fetchone()
    enabled, has_rows_policy = state or (False, False)
    if enabled and not has_rows_policy:  # adding it would widen someone's own policies
        raise ConfigError(
            f"row-level security on {schema}.outbox is on, without the policy outbox_rows "
            "that `grant --aggregate-types` creates: policies of your own decide who may "
            "read and write the outbox; restrict the writer role in them"
        )
    if not enabled:
        if not has_rows_policy:
            conn.execute(sql.SQL(blocks["rows_policy"]).format(**names))
        conn.execute(sql.SQL(blocks["enable_row_security"]).format(**names))
    conn.execute(
        sql.SQL(blocks["writer_types_policy"]).format(
            policy=sql.Identifier(_types_policy(role)), types=sql.Literal(list(types)), **names
        )
    )
    return f"aggregate types {', '.join(types)} (only) to {role}"


def _types_policy(role: str) -> str:
    """The policy's name, which Postgres's refusal quotes: the role's, when it fits in an
    identifier (63 bytes)."""
    name = f"aggregate types of {role}"
    if len(name.encode()) <= 63:
        return name
    return f"aggregate types of role {hashlib.sha256(role.encode()).hexdigest()[:32]}"
