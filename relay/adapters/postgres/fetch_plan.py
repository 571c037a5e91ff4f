"""The relay's fetch, the hot path (docs/design.md §1): one plan per selection.

A :class:`FetchPlan` is chosen once per :class:`~relay.core.ports.Selection` (and
schema): the query of fetch.sql that serves its filters, its parameters but the
checkpoint, whether it is prepared, and how its rows are read. The store runs
it; nothing downstream compares query names.

Rows come back in :data:`EVENT_COLUMNS` order (fetch_rules.sql, ``fetched_columns``),
after the read extent of a filtered fetch (``FetchPlan.read``), and are read by position
from plain tuples: the fetch is the hot path, and a row factory that found the columns by
name cost the filtered fetches 6-16% more client CPU per row (a Python call per row). The
names are checked against what Postgres returns in
tests/integration/test_fetch_plan.py instead.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from psycopg import Cursor
from psycopg.types.json import set_json_loads
from psycopg.types.numeric import Int8BinaryLoader
from psycopg.types.string import ByteaBinaryLoader

from relay.adapters.postgres.db import has_digit_run, has_long_number
from relay.adapters.postgres.queries import queries_for
from relay.core.model import FetchedEvent, OutboxEvent, Position, Unreadable
from relay.core.ports import Fetched, Selection

# What every fetch returns of an event, in this order (fetch_rules.sql).
EVENT_COLUMNS = (
    "transaction_id",
    "position",
    "message_id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "event_type",
    "payload",
    "headers",
    "occurred_at",
    "counted_bytes",
    "debezium",
    "too_large_bytes",
    "id_text",
)

# What a filtered fetch's rows say first: how far the read went (read_any: always true
# in a row that comes back).
_READ_FILTERED: tuple[str, ...] = ("read_transaction_id", "read_position", "read_full")
_READ_OF_TYPE: tuple[str, ...] = ("read_transaction_id", "read_position", "read_any")
_Rows = list[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """How the fetches of one selection run."""

    name: str  # the query's, in fetch.sql
    query: bytes
    params: dict[str, Any]  # all but the checkpoint
    # A part's poll is planned with its part as a constant (never a prepared, generic
    # plan): only then may the planner use the part's index.
    prepare: bool
    read: tuple[str, ...]  # the columns before EVENT_COLUMNS: how far a filtered read went
    decode: Callable[[_Rows, Selection], Fetched]

    def params_after(self, after: Position) -> dict[str, Any]:
        return {**self.params, "transaction_id": after.transaction_id, "position": after.position}


@functools.lru_cache(maxsize=1024)
def plan(schema: str, selection: Selection) -> FetchPlan:
    """The plan of ``selection``'s fetches. A subscriber of one aggregate type reads only
    its own rows (fetch_batch_of_type); other filters read every row and leave behind
    what they drop (fetch_batch_filtered); no filter, fetch_batch."""
    aggregate_types, event_types = selection.aggregate_types, selection.event_types
    one_type = (
        next(iter(aggregate_types)) if aggregate_types and len(aggregate_types) == 1 else None
    )
    params = {
        "limit": selection.limit,
        "max_bytes": selection.max_bytes,
        "max_row_bytes": selection.max_row_bytes,
        "part": selection.part,
        "parts": selection.parts,
        "aggregate_types": sorted(aggregate_types) if aggregate_types is not None else None,
        "event_types": sorted(event_types) if event_types is not None else None,
        "aggregate_type": one_type,
    }
    if one_type is not None:
        name, read, decode = "fetch_batch_of_type", _READ_OF_TYPE, _of_type
    elif aggregate_types is not None or event_types is not None:
        name, read, decode = "fetch_batch_filtered", _READ_FILTERED, _filtered
    else:
        name, read, decode = "fetch_batch", (), _unfiltered
    query = queries_for(schema)[name]
    return FetchPlan(name, query, params, selection.parts == 1, read, decode)


def set_loaders(cur: Cursor[Any]) -> None:
    """How a (binary) fetch cursor loads its rows: JSON as :func:`load_row_json`; the
    message id and the commit time as Postgres sends them (the uuid's 16 bytes,
    timestamptz's microseconds since 2000-01-01, both loaded in C), which
    :class:`~relay.core.model.FetchedEvent` makes into a UUID and a datetime when read:
    the hot path reads neither (issue #53). No other column of a fetch is either type."""
    set_json_loads(load_row_json, cur)
    cur.adapters.register_loader("uuid", ByteaBinaryLoader)
    cur.adapters.register_loader("timestamptz", Int8BinaryLoader)


def _unfiltered(rows: _Rows, selection: Selection) -> Fetched:
    """fetch_batch's rows: events only."""
    events = _events(rows, selection)
    if not events:
        return Fetched([], None)
    return Fetched(events, events[-1].key, _full(events, selection))


def _filtered(rows: _Rows, selection: Selection) -> Fetched:
    """fetch_batch_filtered's rows: each says how far the read went, and if it came back
    full; a row of NULLs after that when the filters kept none."""
    if not rows:
        return Fetched([], None)
    read_tx, read_pos, full = rows[0][:3]
    events = _events([row[3:] for row in rows if row[3] is not None], selection)
    return Fetched(events, Position(read_tx, read_pos), full)


def _of_type(rows: _Rows, selection: Selection) -> Fetched:
    """fetch_batch_of_type's rows: a full fetch read up to its last event; a short one,
    everything decided below the horizon."""
    if not rows:
        return Fetched([], None)
    read_tx, read_pos = rows[0][:2]
    events = _events([row[3:] for row in rows if row[3] is not None], selection)
    full = _full(events, selection)
    return Fetched(events, events[-1].key if full else Position(read_tx, read_pos), full)


def _events(rows: _Rows, selection: Selection) -> list[OutboxEvent]:
    """The events of rows in EVENT_COLUMNS order, the hot path: no Python call per row
    but the comprehension's; their payloads loaded, or left as text (``raw_payloads``)."""
    limit = selection.max_row_bytes
    load = raw_payloads if selection.raw_payloads else payloads
    return [
        _new_event(
            (
                tx,
                pos,
                mid,
                atype,
                aid,
                version,
                etype,
                payload if big is None else _not_read(big, limit),
                headers or {},
                at,
                size,
                dbz,
                id_text,
            )
        )
        for (
            (tx, pos, mid, atype, aid, version, etype, _, headers, at, size, dbz, big, id_text),
            payload,
        ) in zip(rows, load([row[7] for row in rows]), strict=True)
    ]


# A plain call of tuple.__new__: OutboxEvent's own __new__ is a Python function, and
# the fetch builds thousands of events per batch.
_new_event = functools.partial(tuple.__new__, FetchedEvent)


def _not_read(size: int, limit: int) -> Unreadable:
    """What stands in for the payload of a row the fetch left unread: its poison."""
    return Unreadable(
        f"too large to publish: the row holds {size} bytes (its payload, headers and text "
        f"columns), over the {limit} bytes a row may hold (twice message.max.bytes: no "
        "record of it could fit); it was not read",
        read=False,
    )


def _full(events: list[OutboxEvent], selection: Selection) -> bool:
    """Whether a fetch came back full: ``limit`` events, or cut at ``max_bytes`` (the
    fetch returns what it counted of each row)."""
    return (
        len(events) >= selection.limit or sum(e.stored_bytes for e in events) >= selection.max_bytes
    )


def payloads(texts: list[bytes | None]) -> list[Any]:
    """The payloads of a batch, from their JSON text (None: a row not read). orjson over
    the whole batch in one C loop, the common case; a batch with a row it refuses (or a
    row not read) goes row by row through :func:`load_row_json`, which never raises."""
    try:
        # One check over the batch: orjson changes integers beyond 64 bits into floats.
        if not has_long_number(b" ".join(texts)):  # type: ignore[arg-type]
            return list(map(orjson.loads, texts))  # type: ignore[arg-type]
    except (orjson.JSONDecodeError, TypeError):
        pass
    return [None if text is None else load_row_json(text) for text in texts]


def raw_payloads(texts: list[bytes | None]) -> list[Any]:
    """The payloads of a batch as their JSON text (None: a row not read), for a format
    that passes them through, but the rows Python may not load or write: a number of
    :data:`_HUGE` digits or more (beyond a double, or an integer over Python's 4,300
    digits: poison), nesting perhaps deeper than Python goes. Those are loaded as
    before, so a row that was poison stays poison (docs/design.md, "Value formats").
    The usual batch costs two looks over it in C (issue #53)."""
    try:
        joined = b" ".join(texts)  # type: ignore[arg-type]
    except TypeError:  # a row not read: row by row
        return [None if text is None else _raw_or_loaded(text) for text in texts]
    # Every 16th byte: a run of _HUGE digits shows there as 19 in a row (has_long_number),
    # at a sixteenth of the cost of looking at every byte; a hit is checked row by row.
    if has_long_number(joined[::_STRIDE]):
        return [_raw_or_loaded(text) for text in texts]  # type: ignore[arg-type]
    if max(map(len, texts), default=0) > _MAY_BE_DEEP:  # type: ignore[arg-type]
        return [load_row_json(t) if _deep(t) else t for t in texts]  # type: ignore[arg-type]
    return texts


# jsonb's text writes every digit of a number (never an exponent): a number beyond a
# double has 309 digits or more. A run of _HUGE digits spans 19 multiples of _STRIDE.
_STRIDE = 16
_HUGE = 19 * _STRIDE
_HUGE_RUN = b"0" * _HUGE
# Nesting deeper than this is beyond orjson (the standard library's recursion limit lies
# not far beyond): such a row is loaded, as before. Its text holds at least two bytes a
# level, so a shorter one is never that deep.
_DEEP = 255
_MAY_BE_DEEP = 2 * _DEEP


def _raw_or_loaded(text: bytes) -> Any:
    huge = has_digit_run(text, _HUGE_RUN)
    return load_row_json(text) if huge or _deep(text) else text


def _deep(text: bytes) -> bool:
    """Whether ``text`` may nest deeper than :data:`_DEEP` (it opens that many)."""
    return len(text) > _MAY_BE_DEEP and text.count(b"[") + text.count(b"{") > _DEEP


def load_row_json(data: bytes | bytearray | memoryview | str) -> Any:
    """A row's payload or headers; never raises. Whatever Postgres accepted but Python
    cannot load becomes :class:`Unreadable`, which the encoder treats as that row's
    poison: raising here would fail the whole batch, for ever (docs/design.md §6).

    As :func:`relay.adapters.postgres.db.load_json` (orjson, then the standard library for what orjson
    refuses), but a number beyond a double's range is unreadable too: jsonb's numeric
    takes ``1e400``, which the standard library loads as ``inf``, and that was published
    as ``null`` (JSON) or ``Infinity`` (Avro)."""
    text = bytes(data) if isinstance(data, memoryview) else data
    if not has_long_number(text):  # orjson would load a long integer as a float
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # numbers beyond a double
    try:
        return json.loads(text, parse_float=_finite_float)
    except Exception as exc:  # any failure: ValueError, RecursionError, MemoryError...
        return Unreadable(f"{type(exc).__name__}: {str(exc)[:200]}")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]}... ({len(text)} characters) is beyond a double")
    return value
