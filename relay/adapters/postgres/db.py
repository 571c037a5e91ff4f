"""Postgres connections and the mapping of driver errors onto :mod:`relay.errors`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, NamedTuple

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import set_json_loads

from relay.adapters.postgres.queries import queries_for
from relay.core.database_url import parse_url
from relay.core.redact import redact
from relay.errors import (
    ConcurrencyError,
    DatabaseError,
    DatabaseUnavailable,
    NotMigratedError,
    PrivilegeMissing,
    RelayError,
    StaleStreamVersion,
    StreamConflict,
    StreamVersionAhead,
    UndefinedFunctionError,
)


class SqlState:
    """The SQLSTATEs the relay tells apart: whole codes, and classes (a code's first two
    characters, see the PostgreSQL manual's appendix "PostgreSQL Error Codes")."""

    # Raised by the outbox's stream-order trigger (relay/adapters/postgres/sql/schema.sql): the version
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
    # The session was ended by idle_in_transaction_session_timeout (the relay sets one):
    # reconnect. (A lock not granted within lock_timeout, 55P03, is an OperationalError.)
    IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
    # A write on a read-only server: a standby during a failover (the session landed on
    # one, or its primary was demoted). It passes once a primary serves (issue #49).
    READ_ONLY_SQL_TRANSACTION = "25006"
    # Classes that pass: the connection, the server's resources, an administrator's
    # shutdown or cancel (statement_timeout's too, 57014), an I/O error.
    CONNECTION_EXCEPTION = "08"
    INSUFFICIENT_RESOURCES = "53"
    OPERATOR_INTERVENTION = "57"
    SYSTEM_ERROR = "58"


_INSUFFICIENT_PRIVILEGE = "42501"
_FATAL_CLASSES = (
    SqlState.INVALID_AUTHORIZATION,
    SqlState.INVALID_CATALOG_NAME,
    SqlState.SYNTAX_ERROR_OR_ACCESS_RULE,
)
_PASSING_CODES = (SqlState.IDLE_IN_TRANSACTION_TIMEOUT, SqlState.READ_ONLY_SQL_TRANSACTION)
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


def classify(exc: psycopg.Error, *secrets: str | None) -> RelayError:
    """The relay error :class:`wrap_errors` would raise for ``exc``."""
    return _classify(exc, secrets, None)


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


# A refused login carries no SQLSTATE (libpq reports it as a connection failure), so
# these are told from an unreachable server by the server's words: each is permanent,
# and says what fixes it (issue #28: they used to be retried for ever).
_AUTHENTICATION = re.compile(
    r'password authentication failed|role ".*" does not exist|no pg_hba\.conf entry'
    # libpq's own: the server asks for a password the URL does not give.
    r"|authentication failed|no password supplied"
)
_AUTHENTICATION_FIX = "fix the user or password in database_url (or the server's pg_hba.conf)"
_REFUSED_LOGINS = (
    (re.compile(r'database ".*" does not exist'), "create the database, or fix database_url"),
    (_AUTHENTICATION, _AUTHENTICATION_FIX),
    (
        re.compile(r"permission denied for database|does not have CONNECT privilege"),
        "let the role connect: `outbox-relay grant --relay-role ROLE` as the owner",
    ),
)
_GRANT_HINT = (
    "the role lacks a privilege the relay needs: run `outbox-relay grant --relay-role ROLE` "
    "(and `--writer-role` for writers) as the owner of the outbox tables"
)
# Postgres's words when a row-level security policy refused a row (42501 too).
_ROW_SECURITY = "row-level security policy"
# A writer role restricted to some aggregate types (row-level security, set up by
# `grant --aggregate-types`) inserted another: the row's type is refused, no grant missing.
_TYPES_HINT = (
    "this role may not write events of that aggregate type: `outbox-relay grant "
    "--writer-role ROLE --aggregate-types ...` names the types a writer role may write"
)


def _refused_login(exc: psycopg.Error, text: str) -> DatabaseError | None:
    if exc.sqlstate or not isinstance(exc, psycopg.OperationalError):
        return None
    for pattern, fix in _REFUSED_LOGINS:
        if pattern.search(text):
            return DatabaseError(
                f"postgres refused the connection (permanent: retrying cannot fix it): "
                f"{text}; {fix}"
            )
    return None


class Refusal(NamedTuple):
    """Why Postgres refused a connection (a stable name: ``cause``), and what fixes it."""

    cause: str
    remedy: str


# A connection refused, by cause: its SQLSTATEs (a refusal at connect time usually has
# none) and the server's or libpq's words, first match wins. Each says what helps: "raise
# max_connections" for every refusal sent operators the wrong way during a failover, a
# partition and a rotated password alike (issue #49). Order: a multi-host URL's error
# names every host's failure, and a standby among them says more than a host that is down.
_REFUSALS = (
    (
        Refusal(
            "too_many_clients",
            "Raise max_connections (or the role's CONNECTION LIMIT), or lower "
            "max_db_connections x workers x replicas (deploy/README.md)",
        ),
        {"53300"},
        re.compile(
            r"too many clients|too many connections for|remaining connection slots are reserved"
        ),
    ),
    (
        Refusal(
            "authentication",
            f"Authentication failed: {_AUTHENTICATION_FIX}, or PGPASSWORD; retries cannot "
            "succeed until then",
        ),
        {"28P01", "28000"},
        _AUTHENTICATION,
    ),
    (
        Refusal(
            "read_only",
            "The server is a standby or read-only (a failover under way?): the relay waits "
            "for a primary. List every host in database_url with target_session_attrs="
            "read-write so that it follows the failover (deploy/README.md, Connection URL)",
        ),
        {"25006"},
        # libpq's words for a host target_session_attrs passed over, and the server's.
        re.compile(r"session is read-only|in a read-only transaction|is in hot standby mode"),
    ),
    (
        Refusal(
            "unreachable",
            "Postgres does not answer (down, restarting, or the network between): check "
            "the hosts and ports of database_url; the relay reconnects once it answers",
        ),
        {"57P03", "08001", "08006"},
        re.compile(
            r"connection refused|timeout expired|timed out|could not connect|no route to host"
            r"|network is unreachable|could not translate host name|name or service not known"
            r"|server closed the connection|connection reset|could not receive data"
            r"|starting up|shutting down|in recovery mode|not yet accepting connections"
        ),
    ),
)
_OTHER_REFUSAL = Refusal("other", "The server's log says why")


def refusal(exc: psycopg.Error) -> Refusal:
    """Why Postgres refused a connection, and its remedy (for the log: the error itself
    is classified by :func:`classify`)."""
    text = str(exc)
    lowered = text.lower()
    for cause, codes, words in _REFUSALS:
        if exc.sqlstate in codes or words.search(lowered):
            return cause
    for pattern, fix in _REFUSED_LOGINS:  # a missing database, no CONNECT privilege
        if pattern.search(text):
            return Refusal("login", fix[:1].upper() + fix[1:])
    return _OTHER_REFUSAL


def _by_class(exc: psycopg.Error, sqlstate: str, text: str) -> RelayError:
    """Fatal, retry the transaction, or retry later: by the SQLSTATE's class."""
    error_class = sqlstate[:2]
    if sqlstate == _INSUFFICIENT_PRIVILEGE and _ROW_SECURITY not in text:
        # Permanent for a command or a start (they end, naming the grant); a running
        # relay's parts wait for it: a grant restored heals them (issue #48).
        return PrivilegeMissing(
            f"postgres refused the operation [{sqlstate}] (permanent until granted): "
            f"{text}; {_GRANT_HINT}",
            sqlstate=exc.sqlstate,
        )
    if error_class in _FATAL_CLASSES:
        # 42501 here is a row-level security policy's refusal: the row's type.
        hint = f"; {_TYPES_HINT}" if sqlstate == _INSUFFICIENT_PRIVILEGE else ""
        return DatabaseError(
            f"postgres refused the operation [{sqlstate}] (permanent: retrying cannot fix "
            f"it): {text}{hint}",
            sqlstate=exc.sqlstate,
        )
    if (refused := _refused_login(exc, text)) is not None:
        return refused
    if error_class == SqlState.TRANSACTION_ROLLBACK:
        return ConcurrencyError(
            f"postgres rolled the transaction back [{sqlstate}]: {text}; "
            "retry the whole transaction",
            sqlstate=exc.sqlstate,
        )
    if isinstance(exc, psycopg.OperationalError):
        return DatabaseUnavailable(f"postgres is unavailable: {text}", sqlstate=exc.sqlstate)
    if error_class in _PASSING_CLASSES or sqlstate in _PASSING_CODES:
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
    that jsonb accepts, and for what orjson would change (:func:`has_long_number`)."""
    text = bytes(data) if isinstance(data, memoryview) else data
    if not has_long_number(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


# Every byte that is a digit becomes "0", every other a space: a run of _LONG digits is
# then one substring search (C speed, unlike a regular expression, about 10x slower).
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG = b"0" * 19


def has_long_number(data: bytes | bytearray | str) -> bool:
    """Whether ``data`` holds a run of 19 digits or more: orjson loads an integer beyond
    64 bits (up to a double's range) as a float, so ``100000000000000000000000`` would be
    published as ``1e+23``, silently changed. The standard library keeps it exact. (A
    run inside a string or a long fraction goes that way too: slower, never wrong.)"""
    raw = data.encode() if isinstance(data, str) else data
    return _LONG in raw.translate(_DIGITS)


def has_digit_run(data: bytes, run: bytes) -> bool:
    """Whether ``data`` holds ``len(run)`` digits in a row (``run``: that many "0")."""
    return run in data.translate(_DIGITS)


class SessionTimeouts(NamedTuple):
    """Postgres session limits, in seconds (0: none): ``statement_timeout``,
    ``lock_timeout`` and ``idle_in_transaction_session_timeout``."""

    statement: float
    lock: float
    idle_in_transaction: float


def connect(
    url: str,
    *,
    autocommit: bool = True,
    timeouts: SessionTimeouts | None = None,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """Open a connection, mapping failures onto relay errors; with ``timeouts``, a
    daemon's session (:func:`configure`)."""
    params = connect_params(url, autocommit=autocommit, **kwargs)
    with wrap_errors(parse_url(url).get("password")):
        conn = psycopg.connect(url, **params)
        try:
            configure(conn, timeouts)
        except BaseException:
            conn.close()
            raise
    return conn


def connect_params(url: str, *, autocommit: bool = True, **kwargs: Any) -> dict[str, Any]:
    """The parameters every relay connection is opened with, beyond ``url``'s own
    (relay/adapters/postgres/pool.py opens its connections with them too)."""
    given = parse_url(url)
    defaults = {k: v for k, v in _LIVENESS_DEFAULTS.items() if k not in given}
    return {**defaults, **kwargs, "autocommit": autocommit}


# Every connection the relay opens resolves names in pg_catalog, then pg_temp, and
# nowhere else (docs/design.md §2, "Names"): a role that may CREATE in a schema on
# the server's default path (PUBLIC in `public` before Postgres 15) cannot put a better
# matching overload of a built-in, or of the relay's own functions, in front of the
# relay's queries. pg_temp last: a temporary table never shadows a relation. The relay's
# own schema is always named in full.
PINNED_SEARCH_PATH = "pg_catalog, pg_temp"


def configure(conn: psycopg.Connection[Any], timeouts: SessionTimeouts | None = None) -> None:
    """What every relay connection gets once opened, pooled or not
    (relay/adapters/postgres/pool.py): its ``search_path`` pinned to
    :data:`PINNED_SEARCH_PATH`; with ``timeouts`` (the daemon's connections), the
    session's timeouts and UTC as its time zone too, in the same round trip. By a query
    rather than libpq's ``options``, which poolers refuse; so the statements the relay
    runs qualify their calls as well: a pooler in transaction mode may hand them another
    session's backend, whose path the relay did not pin."""
    params: dict[str, str] = {"search_path": PINNED_SEARCH_PATH}
    queries = queries_for("public")  # these name no table: any schema will do
    if timeouts is None:
        conn.execute(queries["pin_search_path"], params)
    else:
        conn.execute(queries["configure_daemon_session"], {**params, **_timeout_ms(timeouts)})
    if not conn.autocommit:
        conn.commit()  # a session setting made in a transaction that rolls back is undone
    set_json_loads(load_json, conn)


def _timeout_ms(timeouts: SessionTimeouts) -> dict[str, str]:
    def ms(seconds: float) -> str:
        return str(round(seconds * 1000))

    return {
        "statement_timeout": ms(timeouts.statement),
        "lock_timeout": ms(timeouts.lock),
        "idle_in_transaction": ms(timeouts.idle_in_transaction),
    }


@contextmanager
def role_search_path(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Inside, in a transaction of its own: the connecting role's own search_path, the
    one :func:`configure` pinned over. Only for looking up what an operator names
    without a schema (a Debezium table, the schemas ``migrate`` checks), as psql would
    find it; nothing else runs there."""
    queries = queries_for("public")
    with wrap_errors(), conn.transaction():
        conn.execute(queries["use_role_search_path"])
        yield
        # A savepoint's release keeps a local setting until the whole transaction ends.
        conn.execute(queries["pin_search_path_locally"], {"search_path": PINNED_SEARCH_PATH})


def role_schemas(conn: psycopg.Connection[Any]) -> list[str]:
    """The existing schemas of the connecting role's own search_path, in order (its
    "$user" schema included when there is one; pg_catalog and pg_temp left out)."""
    with role_search_path(conn):
        row = conn.execute(queries_for("public")["current_schemas"]).fetchone()
    return [] if row is None else list(row[0])
