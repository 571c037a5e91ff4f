"""Which xid space the outbox's ordering keys are in, and what a move to another does.

The keys are transaction ids of the cluster that wrote them. A restore into another
cluster (pg_dump/pg_restore, logical replication) can land them above the ids the new
cluster hands out: without a check, committed rows wait forever and new rows sort
before the checkpoint and are never published. Every relay connection runs the check
(``outbox_check_key_space()``, migration 0004) before it publishes or prunes; it
rebases the keys when they do not fit. docs/design.md, "Moving the database".

Here: the check's outcome, logged once, and which Kafka-side checkpoint may be adopted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from uuid import UUID

from relay.core.log_fields import log_extra
from relay.core.model import KafkaCheckpoint, Position

logger = logging.getLogger(__name__)

_LAST_POSITION = 2**63 - 1


class KeySpaceAction(StrEnum):
    UNCHANGED = "unchanged"
    # The cluster changed, but its ids are above every stored key: nothing to do.
    CONTINUED = "continued"
    # The stored keys were rewritten below this cluster's ids.
    REBASED = "rebased"


@dataclass(frozen=True)
class KeySpaceCheck:
    action: KeySpaceAction
    key_space: UUID
    rebased_rows: int
    detail: str | None


@dataclass(frozen=True)
class KeySpace:
    """The stored keys' space, the one it was rebased from, and the highest key from
    before the last cluster change that kept the space (None: no such change)."""

    id: UUID
    previous: UUID | None
    moved_high: int | None


def report(check: KeySpaceCheck, where: str) -> None:
    """Log what a check did: a move is an operator-visible event."""
    if check.action is KeySpaceAction.REBASED:
        logger.warning(
            "%s: the outbox moved to another transaction-id space (%s); rebased %s "
            "unpublished and retained rows below this cluster's ids, in their order, "
            "and moved every checkpoint with them (new key space %s)",
            where,
            check.detail,
            check.rebased_rows,
            check.key_space,
            extra=log_extra(
                "key_space_rebased",
                where=where,
                key_space=check.key_space,
                rebased_rows=check.rebased_rows,
            ),
        )
    elif check.action is KeySpaceAction.CONTINUED:
        logger.warning(
            "%s: the database runs on another cluster (%s); its transaction ids carry on "
            "above the stored keys, nothing to rebase",
            where,
            check.detail,
            extra=log_extra("key_space_continued", where=where, key_space=check.key_space),
        )
    elif check.detail:
        # Unchanged, yet a stored key is above this cluster's ids: without a sign that
        # the database moved (migration 0008), such a key was forged, not restored.
        logger.warning(
            "%s: %s; the database did not move (same cluster, transaction ids not set "
            "back), so nothing was rewritten. Rows with such a key are not published",
            where,
            check.detail,
            extra=log_extra(
                "key_space_suspect", where=where, key_space=check.key_space, key_space_suspect=True
            ),
        )


def adoptable(
    kafka: KafkaCheckpoint,
    space: KeySpace,
    key_of: Callable[[UUID], Position | None],
    translate: Callable[[UUID, Position], Position],
) -> tuple[Position | None, str]:
    """How far a Kafka-side checkpoint proves events published, in this database's keys,
    and why; None when it cannot be shown to belong to this database's history.

    ``key_of`` finds a message's key here; ``translate`` maps a key of a previous key
    space onto the rebased one.
    """
    written_in = kafka.key_space
    if written_in is None:  # written before key spaces existed: the space of that time
        written_in = space.previous if space.previous is not None else space.id
    if written_in == space.previous:
        return translate(written_in, kafka.position), "translated from the previous key space"
    if written_in != space.id:
        return None, f"written in key space {written_in}, unknown here"
    if kafka.message_id is not None:
        key = key_of(kafka.message_id)
        if key is not None and key <= kafka.position:
            return kafka.position, f"its last event {kafka.message_id} is here"
    if space.moved_high is not None:
        # The database is an earlier state of this history, restored on a cluster whose
        # ids are above every key it holds: each row up to the move that the checkpoint
        # covers was published, and every row written since sorts after the move.
        return min(kafka.position, Position(space.moved_high, _LAST_POSITION)), (
            "this database was moved; adopted up to the move"
        )
    if kafka.message_id is None:
        return kafka.position, "written by an earlier relay version"
    return None, f"its last event {kafka.message_id} is not in this database"
