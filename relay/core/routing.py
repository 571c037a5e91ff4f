"""Routing control for the relay's own formats: which bytes are the record key, which
partition a record goes to, and which of the row's fields go to headers or into an
envelope around the payload (issue #33; Debezium's ``table.field.event.key``,
``table.fields.additional.placement`` and its ``partition`` placement).

A *field* names a value of the outbox row: one of its columns (``aggregate_id``,
``aggregate_type``, ``event_type``, ``message_id``, ``aggregate_version``,
``occurred_at``), a top-level field of its JSON payload (``payload.tenant``), or one of
its headers (``headers.region``). A key is a template over fields
(``"{payload.tenant}:{aggregate_id}"``). A row that lacks a field its subscriber needs
is that row's poison, with the reason: the row was legal to insert, so nothing fails
the app's transaction, and the subscriber's poison policy decides.

Order: the relay publishes each part in database order, and parts split events by
``aggregate_id``. A key finer than the aggregate (``{aggregate_id}.{event_type}``)
keeps that order within each key. A coarser key (``{payload.tenant}``) gets the
database's order for all its events only when the subscriber has one part; with
several, events of one key but different aggregates may interleave differently from
their commit order. docs/design.md says the same.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final
from uuid import UUID

from relay.core.model import (
    HEADER_AGGREGATE_TYPE,
    HEADER_EVENT_TYPE,
    HEADER_ID,
    HEADER_POSITION,
    HEADER_TRANSACTION_ID,
    HEADER_VERSION,
    RESERVED_HEADER_PREFIX,
    OutboxEvent,
)
from relay.errors import EncodingError, SubscriberError

DEFAULT_KEY: Final = "{aggregate_id}"
COLUMNS: Final = frozenset(
    {
        "aggregate_id",
        "aggregate_type",
        "event_type",
        "message_id",
        "aggregate_version",
        "occurred_at",
    }
)
MAX_PLACEMENTS: Final = 32
# The most partitions a partition field may range over (Kafka advises far fewer).
MAX_PARTITION_COUNT: Final = 100_000
RESERVED_HEADER_NAMES: Final = frozenset(
    {
        HEADER_ID,
        HEADER_EVENT_TYPE,
        HEADER_AGGREGATE_TYPE,
        HEADER_TRANSACTION_ID,
        HEADER_POSITION,
        HEADER_VERSION,
    }
)

_FIELD = re.compile(r"^(?:(payload|headers)\.([A-Za-z0-9_$-]{1,128})|([a-z_]+))$")
_TOKEN = re.compile(r"\{([^{}]*)\}")
_ALIAS = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class RowField:
    """A value of the outbox row: ``source`` is "column", "payload" or "headers"."""

    source: str
    name: str

    @classmethod
    def parse(cls, text: str, what: str) -> RowField:
        match = _FIELD.match(text.strip())
        if match is None or (match[3] is not None and match[3] not in COLUMNS):
            raise SubscriberError(
                f"{what}: {text!r} is not a field; use one of {sorted(COLUMNS)}, "
                "payload.<name> or headers.<name>"
            )
        if match[3] is not None:
            return cls("column", match[3])
        return cls(match[1], match[2])

    def __str__(self) -> str:
        return self.name if self.source == "column" else f"{self.source}.{self.name}"

    def value(self, event: OutboxEvent) -> Any:
        """The field's value in ``event``; :data:`_MISSING` when the row has none."""
        if self.source == "column":
            value = getattr(event, self.name)
            return _MISSING if value is None else value
        holder = event.payload if self.source == "payload" else event.headers
        if not isinstance(holder, dict):
            return _MISSING
        return holder.get(self.name, _MISSING)

    def required(self, event: OutboxEvent, purpose: str) -> Any:
        value = self.value(event)
        if value is _MISSING or value is None:
            raise EncodingError(f"event {event.message_id}: {purpose} needs {self}, which it lacks")
        return value


class Placement(StrEnum):
    HEADER = "header"
    ENVELOPE = "envelope"


@dataclass(frozen=True, slots=True)
class Placed:
    """One ``field:placement[:alias]`` item."""

    field: RowField
    placement: Placement
    alias: str

    @classmethod
    def parse(cls, item: str) -> Placed:
        parts = item.strip().split(":")
        what = f"placement {item!r}"
        if len(parts) not in (2, 3):
            raise SubscriberError(
                f"{what}: expected field:header[:alias] or field:envelope[:alias]"
            )
        field = RowField.parse(parts[0], what)
        try:
            placement = Placement(parts[1])
        except ValueError as exc:
            raise SubscriberError(f"{what}: the placement must be header or envelope") from exc
        alias = parts[2] if len(parts) == 3 else field.name
        if not _ALIAS.match(alias):
            raise SubscriberError(f"{what}: the name {alias!r} must be 1-128 of [A-Za-z0-9._-]")
        if placement is Placement.HEADER and (
            alias in RESERVED_HEADER_NAMES or alias.startswith(RESERVED_HEADER_PREFIX)
        ):
            raise SubscriberError(
                f"{what}: the header {alias!r} is the relay's own; give it another alias"
            )
        if placement is Placement.ENVELOPE and alias == "payload":
            raise SubscriberError(f"{what}: 'payload' is the envelope's own field")
        return cls(field, placement, alias)

    def __str__(self) -> str:
        return f"{self.field}:{self.placement.value}:{self.alias}"


@dataclass(frozen=True)
class Routing:
    """A subscriber's key template, partition field and placements, parsed.
    ``partition_count``: the partitions the partition field ranges over (0 to N-1), which
    the subscriber's topics must have (checked at ``subscribers add`` and at start-up)."""

    key: str = DEFAULT_KEY
    partition_by: RowField | None = None
    placements: tuple[Placed, ...] = ()
    partition_count: int | None = None

    @classmethod
    def parse(
        cls,
        key: str | None,
        partition_by: str | None,
        placements: Sequence[str] | None,
        partition_count: int | None = None,
    ) -> Routing:
        template = DEFAULT_KEY if key is None else key
        _key_parts(template)  # validates
        items = tuple(Placed.parse(p) for p in placements or ())
        if len(items) > MAX_PLACEMENTS:
            raise SubscriberError(f"placements: at most {MAX_PLACEMENTS}, got {len(items)}")
        names = [(p.placement, p.alias) for p in items]
        if len(set(names)) != len(names):
            raise SubscriberError("placements: two of them write the same header or envelope field")
        field = None if partition_by is None else RowField.parse(partition_by, "partition_by")
        check_partition_count(partition_by, partition_count)
        return cls(template, field, items, partition_count)

    @property
    def default(self) -> bool:
        return self.key == DEFAULT_KEY and self.partition_by is None and not self.placements

    @functools.cached_property  # read per event: split once
    def envelope(self) -> tuple[Placed, ...]:
        return tuple(p for p in self.placements if p.placement is Placement.ENVELOPE)

    @functools.cached_property
    def headers(self) -> tuple[Placed, ...]:
        return tuple(p for p in self.placements if p.placement is Placement.HEADER)

    def key_text(self, event: OutboxEvent) -> str:
        if self.key == DEFAULT_KEY:
            return event.aggregate_id
        out = []
        for literal, field in _key_parts(self.key):
            out.append(literal)
            if field is not None:
                out.append(_text(field.required(event, "its key")))
        return "".join(out)

    def partition_for(self, event: OutboxEvent) -> int | None:
        if self.partition_by is None:
            return None
        value = self.partition_by.required(event, "its partition")
        if isinstance(value, str) and value.isascii() and value.isdigit():
            value = int(value)
        if type(value) is not int or value < 0 or value > 2**31 - 1:
            raise EncodingError(
                f"event {event.message_id}: its partition ({self.partition_by}) is "
                f"{json.dumps(value, default=str)}, not a partition number (0 or more)"
            )
        if self.partition_count is not None and value >= self.partition_count:
            raise EncodingError(
                f"event {event.message_id}: its partition ({self.partition_by}) is {value}, "
                f"out of range: the subscriber's partition_count is {self.partition_count} "
                f"(partitions 0 to {self.partition_count - 1})"
            )
        return value

    def header_values(self, event: OutboxEvent) -> list[tuple[str, bytes | None]]:
        """The header placements: a field the row lacks is a header without a value."""
        found = []
        for placed in self.headers:
            value = placed.field.value(event)
            missing = value is _MISSING or value is None
            found.append((placed.alias, None if missing else _text(value).encode()))
        return found

    def envelope_values(self, event: OutboxEvent) -> dict[str, Any]:
        """The envelope placements, as JSON values (a field the row lacks is null)."""
        found = {}
        for placed in self.envelope:
            value = placed.field.value(event)
            found[placed.alias] = None if value is _MISSING else _json_value(value)
        return found


def check_partition_count(partition_by: str | None, partition_count: int | None) -> None:
    """A partition field comes with the number of partitions its values range over: the
    relay can then check that the subscriber's topics have them before any row names
    one (a row naming one beyond is that row's poison)."""
    if partition_by is not None and partition_count is None:
        raise SubscriberError(
            "partition_by (--partition-by) needs partition_count (--partition-count): the "
            "number of partitions its values range over (0 to N-1), which the subscriber's "
            "topics must have"
        )
    if partition_by is None and partition_count is not None:
        raise SubscriberError(
            "partition_count (--partition-count) is used only with partition_by "
            "(--partition-by); add it, or drop partition_count"
        )
    if partition_count is not None and not 1 <= partition_count <= MAX_PARTITION_COUNT:
        raise SubscriberError(
            f"partition_count (--partition-count): 1 to {MAX_PARTITION_COUNT}, "
            f"got {partition_count}"
        )


@functools.lru_cache(maxsize=256)
def _key_parts(template: str) -> tuple[tuple[str, RowField | None], ...]:
    """The template as (literal, field) pairs; :class:`SubscriberError` when malformed
    (cached: it runs per event)."""
    if not template or len(template) > 512:
        raise SubscriberError(f"key {template!r}: 1-512 characters, e.g. {DEFAULT_KEY!r}")
    parts: list[tuple[str, RowField | None]] = []
    at = 0
    for match in _TOKEN.finditer(template):
        parts.append((template[at : match.start()], RowField.parse(match[1], f"key {template!r}")))
        at = match.end()
    rest = template[at:]
    if "{" in rest or "}" in rest or any("{" in lit or "}" in lit for lit, _ in parts):
        raise SubscriberError(f"key {template!r}: unbalanced braces")
    parts.append((rest, None))
    if all(field is None for _, field in parts):
        raise SubscriberError(
            f"key {template!r} names no field: every event would have the same key"
        )
    return tuple(parts)


def _text(value: Any) -> str:
    """A value as key or header text: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, str | int | float | bool | list | dict) or value is None:
        return value
    return str(value)  # uuid
