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
from relay.core.ports import PartStore, TopicRecord
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, TopicGuard
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


def adopt_topics(
    settings: Settings, guard: TopicGuard, record: TopicRecord, subscribers: list[Subscriber]
) -> None:
    """On an outbox that published before migration 0017, record as its own the existing
    topics its subscribers' templates let rows reach: its relays created them (or
    published there) before the record existed, and its rows must keep reaching them.
    Once, by whichever relay starts first; a new outbox adopts nothing (issue #47).
    Trust on first use: a topic of another outbox that a template already reached is
    adopted too, so the log names every one adopted, for the operator to review."""
    if not record.adoption_pending():
        return
    from relay.adapters.kafka.topics import admin_client, list_topics

    guard.update(subscribers)
    client = {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
    found = sorted(t.name for t in list_topics(admin_client(client)) if guard.row_chosen(t.name))
    if record.adopt(found) and found:
        shown = ", ".join(found[:_ADOPTED_SHOWN]) + (" ..." if len(found) > _ADOPTED_SHOWN else "")
        logger.warning(
            "adopted %d existing topics the subscribers' templates reach, created before "
            "the outbox recorded its topics (migration 0017): %s. Review them (SELECT topic "
            "FROM outbox_topics WHERE origin = 'adopted'); DELETE the row of any that is "
            "not this outbox's, and rows will no longer publish there",
            len(found),
            shown,
            extra=log_extra("topics_adopted", count=len(found), topics=found[:_ADOPTED_SHOWN]),
        )


_ADOPTED_SHOWN = 50


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
