"""Masking secrets in text meant for people: error messages, logs, CLI output.

libpq and psycopg quote the connection string they could not parse, whole, password
included (``missing "=" after "postgresq://u:SECRET@h/db"``), and a URL can turn up in
any message that names where a connection went. So every error path runs its text
through :func:`redact` before it is shown or logged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

# scheme://user:PASSWORD@host... for any scheme (a mistyped one included). Greedy up to
# the last "@" of the word: an unencoded "@" in a password is still masked.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@\"']*:)[^\s\"']*@")
# password=... in key=value conninfo (quoted or not) and in URL query strings.
_KEY_PASSWORD = re.compile(
    r"(?P<head>\b(?:password|passwd|pwd|sslpassword)\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&\"']+)",
    re.IGNORECASE,
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with URL passwords, ``password=`` values and each of ``secrets`` masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    text = _URL_PASSWORD.sub(rf"\g<head>{MASK}@", text)
    return _KEY_PASSWORD.sub(rf"\g<head>{MASK}", text)
