"""What every sink reader gives of the rows it read: (message id, topic), as the
archive's jobs write them (the ``message_id`` and ``topic`` columns)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

from relay.errors import SinkUnreadable

COLUMNS = ["message_id", "topic"]


def message_rows(table: Any, source: object) -> Iterator[tuple[UUID, str]]:
    """Each row of the pyarrow ``table`` (read from ``source``) with a message id, a
    row held twice given twice; a row without one is not the relay's."""
    for mid, topic in zip(*(table.column(c).to_pylist() for c in COLUMNS), strict=True):
        if mid is not None:
            yield _uuid(mid, source), topic


def _uuid(text: str, source: object) -> UUID:
    try:
        return UUID(text)
    except ValueError as exc:
        raise SinkUnreadable(f"{source}: message_id {text!r} is not a UUID") from exc
