"""Dead letters as the operator's commands see them: one listed by ``dead-letters
list``, and one a redrive is to publish again (relay/ops/redrive.py). Read from
Postgres by ``relay.adapters.postgres.dead_letters.DeadLetterStore``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from relay.core.model import OutboxEvent, Position


@dataclass(frozen=True)
class ListedDeadLetter:
    """A dead letter as ``dead-letters list`` shows it."""

    part: int
    key: Position
    message_id: UUID
    topic: str
    error: str
    decided_at: datetime
    redriven_at: datetime | None
    redrive_error: str | None
    aggregate_type: str | None  # None: the outbox row is gone (pruned)
    aggregate_id: str | None
    event_type: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "key": str(self.key),
            "message_id": str(self.message_id),
            "topic": self.topic,
            "error": self.error,
            "decided_at": self.decided_at.isoformat(),
            "redriven_at": self.redriven_at.isoformat() if self.redriven_at else None,
            "redrive_error": self.redrive_error,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "event_type": self.event_type,
        }


@dataclass(frozen=True)
class Candidate:
    """A dead letter to redrive: its key, and its event (None when pruned)."""

    message_id: UUID
    key: Position
    event: OutboxEvent | None
