"""Versioned schema migrations from ``relay/adapters/postgres/sql/migrations/NNNN_name.sql``.

Each migration runs in its own transaction under an advisory lock, so concurrent
``outbox-relay migrate`` runs (several replicas starting at once) are safe and
re-running is a no-op.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import with_schema
from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Arbitrary constant: serialises migrators across processes.
_LOCK_KEY = 0x6F7574626F78

_LEDGER = """
CREATE TABLE IF NOT EXISTS {schema}.outbox_relay_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
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
            "SELECT to_regclass(format('%%I.outbox_relay_migrations', %s::text)) IS NOT NULL",
            (schema,),
        ).fetchone()
        if not exists or not exists[0]:
            return set()
        rows = conn.execute(
            with_schema("SELECT version FROM {schema}.outbox_relay_migrations", schema)
        )
        return {row[0] for row in rows}


def migrate(
    conn: psycopg.Connection[Any], schema: str = "public", *, up_to: int | None = None
) -> list[Migration]:
    """Apply pending migrations (those numbered ``up_to`` at most, if given); returns
    those applied by this call."""
    done: list[Migration] = []
    with wrap_errors():
        for migration in available():
            if up_to is not None and migration.version > up_to:
                break
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
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
