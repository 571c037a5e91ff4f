"""Masking secrets in text meant for people: error messages, logs, CLI output.

libpq and psycopg quote the connection string they could not parse, whole, password
included (``missing "=" after "postgresq://u:SECRET@h/db"``), and a URL can turn up in
any message that names where a connection went. So every error path runs its text
through :func:`redact` before it is shown or logged.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

MASK = "***"
# Secrets only the settings know (Kafka client passwords, keys): masked in every text
# :func:`redact` sees. Shorter ones are not: masking every "kafka" in a log would hide
# more than it protects, and no client library quotes them.
MIN_REMEMBERED = 6
_remembered: set[str] = set()
_remember_lock = threading.Lock()

# scheme://user:PASSWORD@host... for any scheme (a mistyped one included). Greedy up to
# the last "@" of the word: an unencoded "@" in a password is still masked.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@\"']*:)[^\s\"']*@")
# password=... in key=value conninfo (quoted or not) and in URL query strings.
_KEY_PASSWORD = re.compile(
    r"(?P<head>\b(?:password|passwd|pwd|sslpassword)\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&\"']+)",
    re.IGNORECASE,
)


# The password of a connection string given whole (not running text): from the ":" after
# the user name to the last "@", whatever it holds. A password libpq cannot parse (a
# space, a stray "%") is quoted alone in its error, where nothing else would recognize it.
_WHOLE_URL_PASSWORD = re.compile(
    r"^(?P<head>\s*[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#\s]*:).*@", re.DOTALL
)


def mask_url(url: str) -> str:
    """A connection string (URL or conninfo) with its password masked, wherever it is."""
    return redact(_WHOLE_URL_PASSWORD.sub(rf"\g<head>{MASK}@", url, count=1))


# A PEM private key, whoever quotes it.
_PEM_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    re.DOTALL,
)


def remember(secrets: Iterable[str]) -> None:
    """Mask each of ``secrets`` (of at least MIN_REMEMBERED characters) in every later
    :func:`redact`, in this process."""
    # And each line of a multi-line one (a PEM): a repr or JSON escapes its newlines.
    pieces = {piece.strip() for s in secrets for piece in (s, *s.splitlines())}
    with _remember_lock:
        _remembered.update(p for p in pieces if len(p) >= MIN_REMEMBERED)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with URL passwords, ``password=`` values, private keys, remembered
    secrets and each of ``secrets`` masked."""
    for secret in (*secrets, *tuple(_remembered)):  # tuple(): one step, under the GIL
        if secret:
            text = text.replace(secret, MASK)
    text = _PEM_PRIVATE_KEY.sub(rf"-----BEGIN \g<kind>-----{MASK}", text)
    text = _URL_PASSWORD.sub(rf"\g<head>{MASK}@", text)
    return _KEY_PASSWORD.sub(rf"\g<head>{MASK}", text)
