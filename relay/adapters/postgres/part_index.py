"""Part indexes: for a subscriber of N parts, one partial index per part, so that each
part's poll reads only its own rows (docs/design.md §1, "Parts").

Without them a part reads every row of its range and keeps one in N. ``outbox-relay
subscribers add`` and ``outbox-relay migrate`` build them (a relay never does: a build
waits for every transaction open on the outbox to end), and removing the last
subscriber of their part count drops them. Building needs the outbox's owner; without
them each part reads as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import sql

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import parse_named, read_sql
from relay.core.log_fields import log_extra
from relay.errors import DatabaseError

logger = logging.getLogger(__name__)

# Each insert tests the predicate of every part index: past this many parts, a part's
# wasted reads cost less than every writer's extra work.
MAX_INDEXED_PARTS = 32


def ensure(conn: psycopg.Connection[Any], schema: str, parts: int) -> bool:
    """Build the part indexes of ``parts`` parts (``conn`` in autocommit); False when
    this role may not, or when there are too many parts to index."""
    if parts == 1:
        return True
    if parts > MAX_INDEXED_PARTS:
        logger.info(
            "subscribers of %s parts are not indexed per part (more than %s)",
            parts,
            MAX_INDEXED_PARTS,
            extra=log_extra("part_index_skipped", parts=parts),
        )
        return False
    part = 0
    try:
        for part in range(parts):
            _run(conn, "create", schema, parts, part)
    except DatabaseError as exc:
        # A build that failed half-way leaves an invalid index behind, which writers
        # would maintain and the planner never use.
        _drop_quietly(conn, schema, parts, part)
        logger.warning(
            "cannot build the part indexes of %s-part subscribers (%s): each part reads "
            "every row of its range; the outbox's owner builds them with "
            "`outbox-relay migrate`",
            parts,
            exc,
            extra=log_extra("part_index_build_failed", parts=parts, error=exc),
        )
        return False
    return True


def drop_unused(
    conn: psycopg.Connection[Any], schema: str, parts: int, in_use: Iterable[int]
) -> None:
    """Drop the part indexes of ``parts`` parts unless a subscriber still has that many."""
    if parts == 1 or parts > MAX_INDEXED_PARTS or parts in set(in_use):
        return
    try:
        for part in range(parts):
            _run(conn, "drop", schema, parts, part)
    except DatabaseError as exc:
        logger.warning(
            "cannot drop the part indexes of %s parts: %s",
            parts,
            exc,
            extra=log_extra("part_index_drop_failed", parts=parts, error=exc),
        )


def _drop_quietly(conn: psycopg.Connection[Any], schema: str, parts: int, part: int) -> None:
    try:
        _run(conn, "drop", schema, parts, part)
    except DatabaseError as exc:
        logger.debug(
            "could not drop part index %s/%s: %s",
            part,
            parts,
            exc,
            extra=log_extra("part_index_drop_failed", parts=parts, part=part, error=exc),
        )


def _run(conn: psycopg.Connection[Any], name: str, schema: str, parts: int, part: int) -> None:
    statement = sql.SQL(_STATEMENTS[name]).format(
        index=sql.Identifier(f"outbox_part_{parts}_{part}"),
        schema=sql.Identifier(schema),
        parts=sql.Literal(parts),
        part=sql.Literal(part),
    )
    with wrap_errors():
        conn.execute(statement)


_STATEMENTS = parse_named(read_sql("part_index.sql"))
