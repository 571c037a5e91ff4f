"""The write API: append events to the outbox inside the caller's transaction.

Nothing here commits. The events become visible to the relay when, and only when,
the caller's transaction commits; a rollback takes them away with everything else.

Plain SQL works as well (any language)::

    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
    VALUES ('order', '42', 'OrderPlaced', '{"order_id": "42", ...}');
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from relay.adapters.postgres.db import StreamRef, wrap_errors
from relay.adapters.postgres.queries import queries_for, with_schema
from relay.core.schemas import SchemaFolder
from relay.errors import (
    ConcurrencyError,
    IdempotencyKeyReused,
    PayloadValidationError,
    RelayError,
)

Connectable = psycopg.Connection[Any] | psycopg.Transaction

# It runs in the application's session, whose search_path the relay does not own: every
# call and type is qualified (tests/unit/adapters/postgres/test_sql_qualified.py), so nothing a role put in
# a schema on that path can be a better match. (unnest of several arrays is shorthand
# for this ROWS FROM, and only unqualified.)
_STREAM_INSERT = """
INSERT INTO {schema}.outbox
    (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
SELECT %(aggregate_type)s, %(aggregate_id)s, e.version, e.event_type, e.payload, e.headers
  FROM ROWS FROM (pg_catalog.unnest(%(versions)s::pg_catalog.int8[]),
                  pg_catalog.unnest(%(event_types)s::pg_catalog.text[]),
                  pg_catalog.unnest(%(payloads)s::pg_catalog.jsonb[]),
                  pg_catalog.unnest(%(headers)s::pg_catalog.jsonb[]))
       WITH ORDINALITY AS e(version, event_type, payload, headers, n)
 ORDER BY e.n
RETURNING aggregate_version, message_id
"""


@dataclass(frozen=True)
class Event:
    """One event for :meth:`Outbox.append_to_stream`."""

    event_type: str
    payload: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamAppend:
    """What an event-sourced append wrote."""

    version: int
    message_ids: list[UUID]


class Outbox:
    """Appends events, validated against their Avro schemas, to one outbox table."""

    def __init__(self, registry: SchemaFolder | None, *, schema: str = "public") -> None:
        # registry=None skips validation: for apps that publish JSON-only events.
        self.registry = registry
        self.schema = schema
        self._queries = queries_for(schema)

    def append(
        self,
        conn: Connectable,
        *,
        aggregate_type: str,
        aggregate_id: str,
        event_type: str,
        payload: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> UUID:
        """Append one event; returns its message id.

        With an ``idempotency_key`` (unique per writer role and aggregate), appending the
        same event again with the same key writes nothing and returns the first append's
        message id; another event (event type or payload) with a key this role already
        used raises :class:`IdempotencyKeyReused`. Another role's key is not this one's.
        """
        self._check(aggregate_type, aggregate_id, event_type, payload, headers)
        params = {
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "aggregate_version": None,
            "event_type": event_type,
            "payload": _jsonb(event_type, payload),
            "headers": Jsonb(dict(headers or {})),
            "idempotency_key": idempotency_key,
        }
        connection = _connection(conn)
        with wrap_errors():
            if idempotency_key is None:
                return _one(connection.execute(self._queries["append_event"], params).fetchone())
            row = connection.execute(self._queries["append_event_idempotent"], params).fetchone()
            return _one(row) if row is not None else self._first_append(connection, params)

    def _first_append(self, connection: psycopg.Connection[Any], params: dict[str, Any]) -> UUID:
        """The message id of the event that took this append's key first: this writer's
        own (migration 0015), which must be the same event; before that migration, the
        one event with the key, whoever wrote it."""
        queries = self._queries
        scoped = connection.execute(queries["keys_per_writer"], {"schema": self.schema}).fetchone()
        if scoped is not None and scoped[0]:
            row = connection.execute(queries["find_own_by_idempotency_key"], params).fetchone()
            if row is not None and not row[1]:
                raise IdempotencyKeyReused(
                    params["aggregate_type"],
                    params["aggregate_id"],
                    params["idempotency_key"],
                    str(row[0]),
                )
        else:
            row = connection.execute(queries["find_by_idempotency_key"], params).fetchone()
        if row is None:
            raise ConcurrencyError(
                f"idempotency key {params['idempotency_key']!r} of {params['aggregate_type']}/"
                f"{params['aggregate_id']} is held by a transaction this snapshot cannot see; "
                "retry the transaction"
            )
        return _one(row)

    def append_to_stream(
        self,
        conn: Connectable,
        *,
        aggregate_type: str,
        aggregate_id: str,
        expected_version: int,
        events: Sequence[Event],
    ) -> StreamAppend:
        """Append ``events`` as versions ``expected_version + 1 ...`` of one stream.

        One statement, so all or nothing. Raises :class:`ConcurrencyError` when the
        expected version is stale, or when a younger transaction already committed an
        earlier version (publishing by transaction id would then invert the order):
        roll back and retry the whole transaction.
        """
        if expected_version < 0:
            raise PayloadValidationError(
                "-", [f"expected_version must be >= 0, got {expected_version}"]
            )
        if not events:
            return StreamAppend(expected_version, [])
        for event in events:
            self._check(
                aggregate_type, aggregate_id, event.event_type, event.payload, event.headers
            )
        params = {
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "versions": list(range(expected_version + 1, expected_version + 1 + len(events))),
            "event_types": [e.event_type for e in events],
            "payloads": [_jsonb(e.event_type, e.payload) for e in events],
            "headers": [Jsonb(dict(e.headers)) for e in events],
        }
        with wrap_errors(stream=StreamRef(aggregate_type, aggregate_id, expected_version)):
            rows = _connection(conn).execute(self._stream_insert, params).fetchall()
        rows.sort()
        return StreamAppend(rows[-1][0], [row[1] for row in rows])

    @functools.cached_property
    def _stream_insert(self) -> bytes:
        return with_schema(_STREAM_INSERT, self.schema).as_bytes(None)

    def _check(
        self,
        aggregate_type: str,
        aggregate_id: str,
        event_type: str,
        payload: Mapping[str, Any],
        headers: Mapping[str, str] | None,
    ) -> None:
        problems = []
        if not isinstance(aggregate_type, str) or not aggregate_type:
            problems.append("aggregate_type must be a non-empty string")
        if not isinstance(aggregate_id, str) or not aggregate_id:
            problems.append("aggregate_id must be a non-empty string")
        if headers and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            problems.append("headers must map strings to strings")
        try:
            if self.registry is not None:
                self.registry.validate(event_type, payload)
            elif not isinstance(payload, Mapping):
                problems.append("payload must be a JSON object")
        except PayloadValidationError as exc:
            if not problems:
                raise  # as it is (UnknownEventTypeError, say)
            problems.extend(exc.problems)
        if problems:  # every one of them, not the first: the writer fixes them in one go
            raise PayloadValidationError(event_type, problems)


def _jsonb(event_type: str, payload: Mapping[str, Any]) -> Jsonb:
    """The payload as a jsonb parameter, written here once: what JSON cannot hold (a
    set, a datetime, NaN, a cycle) is refused before the database sees it, and the
    transaction stays usable (psycopg would raise a bare TypeError, or Postgres refuse
    NaN and abort the transaction)."""
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadValidationError(
            event_type, [f"payload cannot be written as JSON ({type(exc).__name__}: {exc})"]
        ) from exc
    return Jsonb(text, dumps=_written)


def _written(text: str) -> str:
    return text


def _connection(conn: Connectable) -> psycopg.Connection[Any]:
    return conn.connection if isinstance(conn, psycopg.Transaction) else conn


def _one(row: tuple[Any, ...] | None) -> UUID:
    if row is None:  # INSERT ... RETURNING always returns a row
        raise RelayError("append returned no message id")
    value = row[0]
    assert isinstance(value, UUID)
    return value


@functools.cache
def default_outbox() -> Outbox:
    """An :class:`Outbox` validating against ``$RELAY_SCHEMAS_DIR`` (unset: no validation,
    as the relay then publishes JSON), schema ``public`` (or ``$RELAY_DATABASE_SCHEMA``)."""
    folder = os.environ.get("RELAY_SCHEMAS_DIR")
    registry = SchemaFolder.from_dir(folder) if folder else None
    return Outbox(registry, schema=os.environ.get("RELAY_DATABASE_SCHEMA", "public"))


def append(conn: Connectable, **kwargs: Any) -> UUID:
    """:meth:`Outbox.append` on the :func:`default_outbox`."""
    return default_outbox().append(conn, **kwargs)


def append_to_stream(conn: Connectable, **kwargs: Any) -> StreamAppend:
    """:meth:`Outbox.append_to_stream` on the :func:`default_outbox`."""
    return default_outbox().append_to_stream(conn, **kwargs)
