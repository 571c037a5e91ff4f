"""``outbox-relay topics tail``: a topic's records as a consumer reads them
(``read_committed``: nothing of an aborted transaction), each key and value decoded
by the format it was written in (relay/core/value_decoding.py), with its headers.

Without a limit it follows the topics until interrupted, as ``kafka-console-consumer``
does; ``limit`` stops after that many records and ``idle_timeout`` after that long
without one, so a script (or the README's first event) ends on its own.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from relay.core.model import ConsumedRecord
from relay.core.ports import TopicReader
from relay.core.value_decoding import Decoded

__all__ = ["TailedRecord", "tail"]

# How often the reader hands control back while no record comes (the idle timeout's grain).
_IDLE_S = 0.2


@dataclass(frozen=True)
class TailedRecord:
    """One record read back: where it is, its key, headers and value, decoded."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: Decoded
    headers: list[tuple[str, str | None]]
    value: Decoded

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "key": self.key.as_dict(),
            "headers": [[name, value] for name, value in self.headers],
            "value": self.value.as_dict(),
        }


def tail(
    reader: TopicReader,
    topics: Sequence[str],
    decode: Callable[[bytes | None], Decoded],
    *,
    from_beginning: bool = False,
    limit: int | None = None,
    idle_timeout: float | None = None,
) -> Iterator[TailedRecord]:
    """The records committed to ``topics`` (from their end now, or their beginning), as
    they come, until ``limit`` records or ``idle_timeout`` seconds without one."""
    if limit == 0:
        return
    seen = 0
    quiet_since = time.monotonic()
    records = reader.follow(topics, idle=_IDLE_S, from_beginning=from_beginning)
    with closing(records):
        for record in records:
            if record is None:
                if idle_timeout is not None and time.monotonic() - quiet_since >= idle_timeout:
                    return
                continue
            yield tailed(record, decode)
            seen += 1
            if limit is not None and seen >= limit:
                return
            quiet_since = time.monotonic()


def tailed(record: ConsumedRecord, decode: Callable[[bytes | None], Decoded]) -> TailedRecord:
    return TailedRecord(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        timestamp_ms=record.timestamp_ms,
        key=decode(record.key),
        headers=[(name, header_text(value)) for name, value in record.headers],
        value=decode(record.value),
    )


def header_text(value: bytes | None) -> str | None:
    """A header's value as text; one that is not UTF-8 in base64, so marked."""
    if value is None:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode()
