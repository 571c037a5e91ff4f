"""Log handler setup. Only the CLI calls this; the library only gets loggers."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from relay.core.redact import redact
from relay.core.terminal import printable

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class RedactingFormatter(logging.Formatter):
    """Masks passwords in every line, tracebacks included: a driver error chained under
    a relay error may quote a whole database URL. Escapes control characters: a message
    quoting a row or a server's answer can neither drive the terminal nor start a
    forged line (tracebacks keep their lines)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return printable(super().formatException(ei), keep_newlines=True)

    def formatStack(self, stack_info: str) -> str:
        return printable(super().formatStack(stack_info), keep_newlines=True)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # Masked before encoding, so JSON escapes cannot hide a password from the patterns.
        return json.dumps(
            {k: redact(str(v)) if isinstance(v, str) else v for k, v in entry.items()}, default=str
        )


def configure(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The pool warns at every failed connection attempt; relay/adapters/postgres/pool.py says it once.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
