"""What a waiting part records in its checkpoint row, for ``status`` (issue #48).

A part that waits (for a topic to be created, a privilege or an ACL to be granted, the
schema registry or Kafka to answer, room in ``max_created_topics``) publishes nothing
and halts nothing. Its worker knows why, /metrics and /readyz show it, but ``status``
reads Postgres: so the worker records there what it waits for, and since when, once it
starts waiting, and clears it once a turn goes through again.

Writes are few: one when the wait starts, one when it ends, and one when what it waits
for changes. A wait starts, or changes, at most once every ``every_s`` seconds in the
row, however often the part retries or flaps; its end is written at once, so that
`status` never shows a part that publishes again as waiting. Each is best effort: a write that fails (the relay's role may not write the
row any more, or a schema before migration 0020) is skipped, the wait still shown by
/metrics and /readyz. Nothing is recorded for Postgres itself being unreachable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from uuid import UUID

from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import PartStore
from relay.engine.poison import cap
from relay.errors import RelayError

logger = logging.getLogger(__name__)

_EVERY_S = 30.0
# The error as recorded: enough to name the fix (a topic, a grant), never a whole row.
MAX_WAIT_ERROR_BYTES = 2048
# What cannot be recorded in Postgres while it is what the part waits for.
_UNRECORDED = frozenset({"postgres"})


class WaitRecord:
    """The wait of one part, as its checkpoint row holds it (see the module). Its
    methods take how to get the part's store, opened only to write."""

    def __init__(
        self,
        part: PartId,
        owner: UUID,
        *,
        every_s: float = _EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._part = part
        self._owner = owner
        self._every_s = every_s
        self._clock = clock
        self._recorded: tuple[str, str] | None = None  # what this worker wrote last
        # A previous owner's wait may still be in the row: cleared at the first turn.
        self._stale = True
        self._written_at = -math.inf

    def waiting(self, store: Callable[[], PartStore], waits_on: str, error: str) -> None:
        """The part failed a turn and waits on ``waits_on``, for ``error``."""
        if waits_on in _UNRECORDED:
            return
        wait = (waits_on, cap(error, MAX_WAIT_ERROR_BYTES))
        if wait != self._recorded and self._due():
            self._write(store, wait)

    def done(self, store: Callable[[], PartStore]) -> None:
        """A turn went through: the part waits for nothing (any more)."""
        if self._recorded is not None or self._stale:
            self._write(store, None)

    def _due(self) -> bool:
        return self._clock() - self._written_at >= self._every_s

    def _write(self, store: Callable[[], PartStore], wait: tuple[str, str] | None) -> None:
        self._written_at = self._clock()
        self._recorded, self._stale = wait, False
        waits_on, error = wait if wait is not None else (None, None)
        try:
            store().record_wait(self._part, self._owner, waits_on, error)
        except RelayError as exc:
            logger.debug(
                "part %s: could not record its wait: %s",
                self._part,
                exc,
                extra=log_extra("part_wait_unrecorded", part=self._part, error=exc),
            )
