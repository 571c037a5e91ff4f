"""Versioned schema migrations from ``relay/adapters/postgres/sql/migrations/NNNN_name.sql``.

Each migration runs in its own transaction under an advisory lock, so concurrent
``outbox-relay migrate`` runs (several replicas starting at once) are safe and
re-running is a no-op. Each runs with the search_path pinned (pg_catalog, pg_temp): what
a migration creates binds its calls then, in column defaults, trigger conditions and
SQL function bodies, and a role that may CREATE in a schema on the owner's own path must
not be what they bind to (issue #47).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg

from relay.adapters.postgres import namespaces
from relay.adapters.postgres.advisory import hold_xact_lock
from relay.adapters.postgres.db import PINNED_SEARCH_PATH, wrap_errors
from relay.adapters.postgres.queries import queries_for, with_schema
from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Arbitrary constant: serialises migrators across processes.
LOCK_KEY = 0x6F7574626F78
# How long a migrator waits for another to finish (or for whoever else holds the key:
# any role may take it) before it gives up, naming the holder.
LOCK_WAIT_S = 300.0

_LEDGER = """
CREATE TABLE IF NOT EXISTS {schema}.outbox_relay_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT pg_catalog.now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped with this version, in order."""
    folder = resources.files("relay.adapters.postgres").joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda m: m.version)


def applied(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    with wrap_errors():
        exists = conn.execute(
            "SELECT pg_catalog.to_regclass("
            "pg_catalog.format('%%I.outbox_relay_migrations', %s::text)) IS NOT NULL",
            (schema,),
        ).fetchone()
        if not exists or not exists[0]:
            return set()
        rows = conn.execute(
            with_schema("SELECT version FROM {schema}.outbox_relay_migrations", schema)
        )
        return {row[0] for row in rows}


def migrate(
    conn: psycopg.Connection[Any],
    schema: str = "public",
    *,
    up_to: int | None = None,
    allow_public_create: bool = False,
    lock_wait_s: float = LOCK_WAIT_S,
) -> list[Migration]:
    """Apply pending migrations (those numbered ``up_to`` at most, if given); returns
    those applied by this call. Refuses a schema in which PUBLIC may CREATE unless
    ``allow_public_create`` (:func:`namespaces.check_public_create`); waits at most
    ``lock_wait_s`` for another migrator (:class:`relay.errors.LockTimeout`)."""
    namespaces.check_public_create(conn, schema, allow=allow_public_create, command="migrate")
    done: list[Migration] = []
    pin = queries_for(schema)["pin_search_path_locally"]
    with wrap_errors():
        for migration in available():
            if up_to is not None and migration.version > up_to:
                break
            with conn.transaction():
                conn.execute(pin, {"search_path": PINNED_SEARCH_PATH})
                hold_xact_lock(conn, LOCK_KEY, lock_wait_s, "migration")
                if migration.version in applied(conn, schema):
                    continue
                conn.execute(with_schema("CREATE SCHEMA IF NOT EXISTS {schema}", schema))
                conn.execute(with_schema(_LEDGER, schema))
                conn.execute(with_schema(migration.sql, schema))
                conn.execute(
                    with_schema(
                        "INSERT INTO {schema}.outbox_relay_migrations (version, name) VALUES (%s, %s)",
                        schema,
                    ),
                    (migration.version, migration.name),
                )
            logger.info(
                "applied migration %04d_%s",
                migration.version,
                migration.name,
                extra=log_extra("migration_applied", migration=migration.version, schema=schema),
            )
            done.append(migration)
    return done


# The oldest schema this relay runs on. Later migrations are applied by the migrate step
# of a deploy, before or after the relays roll: both versions of the relay run on both.
RELAY_NEEDS = 2


def pending(conn: psycopg.Connection[Any], schema: str = "public") -> list[Migration]:
    have = applied(conn, schema)
    return [m for m in available() if m.version not in have]
