"""The database URL, read as libpq reads it: its parameters, or an error naming the
setting that never shows the password."""

from __future__ import annotations

from typing import Any

from relay.core.redact import mask_url, redact
from relay.errors import ConfigError


def parse_url(url: str) -> dict[str, Any]:
    """The parameters of a libpq URL or conninfo string; a :class:`ConfigError` when it
    is not one, which never shows the password: libpq quotes the token it could not
    parse, and that may be the password alone (``invalid percent-encoded token:
    "S3cr%ZZet"``), so the error shown is the one of the string with its password masked."""
    # libpq's own parser, imported when called: the logic behind the ports reads the
    # settings, and never loads the database client (tests/unit/test_layers.py).
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        params = None
    if params is not None:
        misread = _misread_password(params)
        if misread is None:
            return params
        # Neither value is quoted: either may hold part of the password.
        raise ConfigError(f"database_url: {misread}; {_ENCODE_PASSWORD}")
    try:
        conninfo_to_dict(mask_url(url))
    except psycopg.Error as exc:
        raise ConfigError(f"database_url: not a libpq URL or conninfo: {redact(str(exc))}") from exc
    # Not chained to libpq's error: its message holds the password.
    raise ConfigError(
        f"database_url: the password is not valid in a URL; {_ENCODE_PASSWORD}"
    ) from None


_ENCODE_PASSWORD = (
    'in a URL, percent-encode "%", " ", "@", "/" and ":" in the password '
    "(as %25, %20, %40, %2F and %3A)"
)


def _misread_password(params: dict[str, Any]) -> str | None:
    """What libpq took of a password for the host or the port, if it did: an unencoded
    "@" leaves part of one in the host ("u:p@ss@host" gives host "ss@host"), a "/" or ":"
    in the port ("u:p/ss@host" gives port "p"). Connecting would quote it in an error."""
    if "@" in str(params.get("host") or ""):
        return 'the host holds an "@"'
    port = str(params.get("port") or "")
    if any(p and not p.isdigit() for p in port.split(",")):
        return "the port is not a number"
    return None
