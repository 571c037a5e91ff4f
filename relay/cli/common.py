"""What every command shares: the consoles, the common options, settings and connections."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Optional

import psycopg
import typer
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Span, Text

from relay.core.log_fields import log_extra
from relay.core.settings import Settings, load_settings, unknown_variables
from relay.core.terminal import printable
from relay.errors import DatabaseUnavailable
from relay.observability import logs

if TYPE_CHECKING:  # relay.wiring is imported when a command runs: it loads the Kafka client
    from relay.wiring import Store

logger = logging.getLogger(__name__)


# Piped or redirected output is not cut to 80 columns (rich's default off a terminal).
def _width(stream: Any) -> int | None:
    if stream.isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else 250


def help_width(stream: Any) -> int | None:
    """The width of ``--help`` on ``stream``: the terminal's, or as wide as its lines
    need off a terminal (rich's default there, 80 columns, cut option names)."""
    width = _width(stream)
    return None if width is None else min(width, 160)


class _Terminal(Console):
    """A console that never lets a control character of what it prints reach the
    terminal (relay/core/terminal.py): every string and rich Text it renders, table
    cells included, is escaped on the way, whoever built it."""

    def render_str(self, text: str, **options: Any) -> Text:
        return super().render_str(printable(text), **options)

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        if isinstance(renderable, Text):
            renderable = _printable_text(renderable)
        return super().render(renderable, options)


def _printable_text(text: Text) -> Text:
    """``text`` escaped as :func:`printable` escapes a string, its styles kept on the
    characters they styled. (A table measures a Text cell before this: give data to
    a table as strings, which are measured escaped.)"""
    plain = text.plain
    if plain.isprintable():
        return text
    pieces = [printable(c) for c in plain]
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + len(piece))
    escaped = text.copy()
    escaped.plain = "".join(pieces)
    escaped.spans = [
        Span(starts[s.start], starts[min(s.end, len(plain))], s.style) for s in text.spans
    ]
    return escaped


# Everything printed comes from data that writers, operators and other database clients
# control (event types, aggregate types, halt errors, application names): none of it is
# parsed as rich markup or emoji codes, and its control characters are escaped
# (_Terminal). Styling is given explicitly, with rich Text.
out = _Terminal(markup=False, emoji=False, highlight=False, width=_width(sys.stdout))
err = _Terminal(stderr=True, markup=False, emoji=False, highlight=False, width=_width(sys.stderr))


def print_json(value: Any, *, indent: int | None = 2) -> None:
    """``--json`` output (``indent`` None: on one line, as JSON Lines): JSON escapes every
    control character in its strings but DEL, escaped here too (it can appear only
    inside a string)."""
    text = json.dumps(value, indent=indent, default=str).replace("\x7f", "\\u007f")
    sys.stdout.write(text + "\n")


# Options shared by several commands. Flags win over RELAY_* variables and the file.
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="libpq URL [RELAY_DATABASE_URL]")
]
Schema = Annotated[
    str | None, typer.Option("--schema", help="Postgres schema [RELAY_DATABASE_SCHEMA]")
]
Bootstrap = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--bootstrap-servers", help="Kafka HOST:PORT[,...] [RELAY_BOOTSTRAP_SERVERS]"),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
AllowPublicCreate = Annotated[
    bool,
    typer.Option(
        "--allow-public-create",
        help="Go on although every role may CREATE in the relay's schema (Postgres before 15 "
        "lets PUBLIC create in `public`): better, REVOKE CREATE ON SCHEMA public FROM PUBLIC "
        "(deploy/README.md, Security).",
    ),
]


@dataclass
class Globals:
    config: Path | None


def _settings(ctx: typer.Context, **flags: Any) -> Settings:
    settings = load_settings(ctx.obj.config, **flags)
    logs.configure(settings.log_level, settings.log_format)
    _warn_unknown_variables()
    return settings


def _warn_unknown_variables() -> None:
    """A mistyped ``RELAY_*`` variable is said, with the name meant, not ignored."""
    for variable, nearest in unknown_variables(os.environ):
        logger.warning(
            "%s is set, but no setting reads it%s",
            variable,
            "" if nearest is None else f" (did you mean {nearest}?)",
            extra=log_extra("settings_unknown_variable", variable=variable, nearest=nearest),
        )


@contextmanager
def _store(settings: Settings) -> Iterator[Store]:
    from relay import wiring

    with wiring.connect(settings) as conn:
        yield wiring.store_on(conn, settings.database_schema)


def _connect_waiting(settings: Settings, application_name: str) -> psycopg.Connection[Any]:
    """A connection, waiting for a Postgres that is down or starting as `run` waits for
    it (backoff up to 30 s, until Ctrl-C or SIGTERM); a permanent refusal (unknown
    database, bad credentials, missing grants) fails at once."""
    from relay import wiring

    delay = 0.5
    while True:
        try:
            return wiring.connect(settings, application_name)
        except DatabaseUnavailable as exc:
            logger.warning(
                "waiting for Postgres: %s; retrying in %.0fs",
                exc,
                delay,
                extra=log_extra("db_waiting", error=exc, retry_in=delay),
            )
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


@contextmanager
def _stop_on_signals(stop: Any) -> Iterator[None]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        logger.info("received %s, stopping", name, extra=log_extra("signal_stopping", signal=name))
        stop()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
