"""Postgres connections and the mapping of driver errors onto :mod:`relay.errors`."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, NamedTuple

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import set_json_loads

from relay.errors import (
    ConcurrencyError,
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    NotMigratedError,
    RelayError,
    StaleStreamVersion,
    StreamConflict,
    StreamVersionAhead,
    UndefinedFunctionError,
)
from relay.redact import redact


class SqlState:
    """The SQLSTATEs the relay tells apart: whole codes, and classes (a code's first two
    characters, see the PostgreSQL manual's appendix "PostgreSQL Error Codes")."""

    # Raised by the outbox's stream-order trigger (relay/sql/schema.sql): the version
    # before the appended one is missing. (RLY02, "an earlier version was written by a
    # younger transaction", was retired by migration 0003 and is no longer raised.)
    STREAM_GAP = "RLY01"
    # Classes a retry cannot fix: bad credentials, missing database, insufficient
    # privilege, syntax or undefined objects.
    INVALID_AUTHORIZATION = "28"
    INVALID_CATALOG_NAME = "3D"
    SYNTAX_ERROR_OR_ACCESS_RULE = "42"
    # The transaction is lost (serialization failure, deadlock): retry all of it.
    TRANSACTION_ROLLBACK = "40"
    # Classes that pass: the connection, the server's resources, an administrator's
    # shutdown or cancel, an I/O error.
    CONNECTION_EXCEPTION = "08"
    INSUFFICIENT_RESOURCES = "53"
    OPERATOR_INTERVENTION = "57"
    SYSTEM_ERROR = "58"


_FATAL_CLASSES = (
    SqlState.INVALID_AUTHORIZATION,
    SqlState.INVALID_CATALOG_NAME,
    SqlState.SYNTAX_ERROR_OR_ACCESS_RULE,
)
_PASSING_CLASSES = (
    SqlState.CONNECTION_EXCEPTION,
    SqlState.INSUFFICIENT_RESOURCES,
    SqlState.OPERATOR_INTERVENTION,
    SqlState.SYSTEM_ERROR,
)


class StreamRef(NamedTuple):
    """The stream an event-sourced append writes to, and the version it expects there."""

    aggregate_type: str
    aggregate_id: str
    expected_version: int


class wrap_errors:
    """The one place psycopg errors become relay errors: re-raised ``from`` the driver's,
    with ``secrets`` masked in their message. Inside an append to ``stream``, a version
    conflict is a :class:`StreamConflict` naming it.

    A class rather than a ``contextlib.contextmanager``: the write API enters it on
    every append, and a generator-based one cost about a microsecond each time."""

    __slots__ = ("_secrets", "_stream")

    def __init__(self, *secrets: str | None, stream: StreamRef | None = None) -> None:
        self._secrets = secrets
        self._stream = stream

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, psycopg.Error):
            raise _classify(exc, self._secrets, self._stream) from exc


def _classify(
    exc: psycopg.Error, secrets: tuple[str | None, ...], stream: StreamRef | None
) -> RelayError:
    """The relay error for a driver error. Its text is redacted: a connection error may
    quote the whole URL, password included."""
    if stream is not None and (conflict := _stream_conflict(exc, stream)) is not None:
        return conflict
    sqlstate = exc.sqlstate or ""
    text = redact(str(exc), secrets)
    if isinstance(exc, pg_errors.UndefinedTable):
        return NotMigratedError(
            f"outbox tables are missing ({text}); run `outbox-relay migrate`", sqlstate=exc.sqlstate
        )
    if isinstance(exc, pg_errors.UndefinedFunction):
        return UndefinedFunctionError(
            f"postgres refused the operation [{sqlstate}]: {text}", sqlstate=exc.sqlstate
        )
    return _by_class(exc, sqlstate, text)


def _by_class(exc: psycopg.Error, sqlstate: str, text: str) -> RelayError:
    """Fatal, retry the transaction, or retry later: by the SQLSTATE's class."""
    error_class = sqlstate[:2]
    if error_class in _FATAL_CLASSES:
        return DatabaseError(
            f"postgres refused the operation [{sqlstate}]: {text}", sqlstate=exc.sqlstate
        )
    if error_class == SqlState.TRANSACTION_ROLLBACK:
        return ConcurrencyError(
            f"postgres rolled the transaction back [{sqlstate}]: {text}; "
            "retry the whole transaction",
            sqlstate=exc.sqlstate,
        )
    if isinstance(exc, psycopg.OperationalError):
        return DatabaseUnavailable(f"postgres is unavailable: {text}", sqlstate=exc.sqlstate)
    if error_class in _PASSING_CLASSES:
        return DatabaseUnavailable(
            f"postgres error [{sqlstate}], will retry: {text}", sqlstate=exc.sqlstate
        )
    return DatabaseError(f"postgres error [{sqlstate}]: {text}", sqlstate=exc.sqlstate)


def _stream_conflict(exc: psycopg.Error, stream: StreamRef) -> StreamConflict | None:
    """A unique violation (the stream's version index: a concurrent append wrote the
    next version first) or the stream-order trigger's refusal (no expected version)."""
    if isinstance(exc, pg_errors.UniqueViolation):
        return StaleStreamVersion(*stream, sqlstate=exc.sqlstate)
    if exc.sqlstate == SqlState.STREAM_GAP:
        return StreamVersionAhead(*stream, sqlstate=exc.sqlstate)
    return None


# Unless the URL says otherwise: fail fast on an unreachable server, and notice a dead
# peer on an idle or half-open connection (a frozen or partitioned Postgres) within about
# half a minute instead of hanging until the kernel gives up.
_LIVENESS_DEFAULTS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def load_json(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON from Postgres: orjson (about 3x faster on the relay's hot path), falling
    back to the standard library for what orjson refuses, such as integers beyond 64 bits
    that jsonb accepts."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)


def parse_url(url: str) -> dict[str, Any]:
    """The parameters of a libpq URL or conninfo string; a :class:`ConfigError` (with the
    password masked: libpq quotes the whole string) when it is not one."""
    try:
        return conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise ConfigError(f"database_url: not a libpq URL or conninfo: {redact(str(exc))}") from exc


def connect(url: str, *, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection, mapping failures onto relay errors."""
    params = connect_params(url, autocommit=autocommit, **kwargs)
    with wrap_errors(parse_url(url).get("password")):
        conn = psycopg.connect(url, **params)
    configure(conn)
    return conn


def connect_params(url: str, *, autocommit: bool = True, **kwargs: Any) -> dict[str, Any]:
    """The parameters every relay connection is opened with, beyond ``url``'s own
    (relay/pool.py opens its connections with them too)."""
    given = parse_url(url)
    defaults = {k: v for k, v in _LIVENESS_DEFAULTS.items() if k not in given}
    return {**defaults, **kwargs, "autocommit": autocommit}


def configure(conn: psycopg.Connection[Any]) -> None:
    """What every relay connection gets once opened, pooled or not."""
    set_json_loads(load_json, conn)
