"""What the relay checks before it publishes: the schema's migrations, and whether the
database moved. (Its subscribers are defined and checked by relay/ops/subscribers.py,
as `subscribers add` defines them.)"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import psycopg

from relay.adapters.postgres import migrations
from relay.core.key_space import KeySpaceAction, report
from relay.core.log_fields import log_extra
from relay.core.ports import PartStore
from relay.errors import NotMigratedError

logger = logging.getLogger(__name__)


def check_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    """Refuse a schema without the migrations the relay needs; warn about newer ones."""
    pending = migrations.pending(conn, schema)
    names = [f"{m.version:04d}_{m.name}" for m in pending]
    if any(m.version <= migrations.RELAY_NEEDS for m in pending):
        raise NotMigratedError(
            f"schema {schema!r} lacks migrations {names}; run `outbox-relay migrate`"
        )
    if pending:
        # A rolling deploy: the relay runs on the older schema; the migration brings
        # per-key database order and an untaxed write path.
        logger.warning(
            "schema %r lacks migrations %s; the relay runs on it, but apply them "
            "(`outbox-relay migrate`)",
            schema,
            names,
            extra=log_extra("schema_migrations_pending", schema=schema, missing=names),
        )


class KeySpaceChecks:
    """Checks whether the database moved to another xid space (docs/design.md §6), and
    counts what was done about each move found."""

    def __init__(self) -> None:
        self.changes: Counter[str] = Counter(rebased=0, continued=0)

    def check(self, store: PartStore, where: str) -> None:
        found = store.check_key_space()
        if found is not None and found.action is not KeySpaceAction.UNCHANGED:
            report(found, where)
            self.changes[found.action.value] += 1
