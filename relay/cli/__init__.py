"""The ``outbox-relay`` command line.

One module per command group; this one builds the Typer app from them, in the order
``--help`` lists them, and holds the entry point (``outbox-relay``, ``python -m relay``
and ``python -m relay.cli``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Annotated, Optional

import psycopg
import typer
import typer.rich_utils

from relay.cli import local, operations, status, verify
from relay.cli.common import Globals, help_width
from relay.cli.dead_letters import dead_letters_app
from relay.cli.debezium import debezium_app
from relay.cli.subscribers import subscribers_app
from relay.cli.topics import topics_app
from relay.core.redact import redact
from relay.core.terminal import printable
from relay.errors import ConfigError, RelayError

__all__ = ["app", "main"]

app = typer.Typer(
    name="outbox-relay",
    help="Publish committed Postgres outbox events to Kafka, in order, per subscriber.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for command in (
    operations.migrate,
    operations.run,
    local.dev,
    local.local,
    verify.verify,
    status.status,
    operations.grant,
    operations.prune,
):
    app.command()(command)
app.add_typer(subscribers_app, name="subscribers")
app.add_typer(debezium_app, name="debezium")
app.add_typer(dead_letters_app, name="dead-letters")
app.add_typer(topics_app, name="topics")


def _print_version(asked: bool) -> None:
    if asked:
        # The installed distribution's: pyproject.toml is its one source (CHANGELOG.md).
        sys.stdout.write(f"outbox-relay {metadata.version('outbox-relay')}\n")
        raise typer.Exit


@app.callback()
def _globals(
    ctx: typer.Context,
    config: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--config", "-c", envvar="RELAY_CONFIG", help="TOML settings file [RELAY_CONFIG]."
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the installed version and exit.",
        ),
    ] = False,
) -> None:
    ctx.obj = Globals(config)


def main() -> None:
    """Console-script entry point: clear errors, meaningful exit codes."""
    if typer.rich_utils.MAX_WIDTH is None:  # unless TERMINAL_WIDTH says
        # Help read off a terminal (piped, in CI) is not cut at rich's 80 columns, where
        # option names and their variables came out truncated (issue #52).
        typer.rich_utils.MAX_WIDTH = help_width(sys.stdout)
    try:
        app(prog_name="outbox-relay")
    except ConfigError as exc:
        _fail(f"configuration error: {exc}", 2)
    except RelayError as exc:
        _fail(str(exc), 1)
    except psycopg.Error as exc:  # should have been wrapped; never show a traceback for it
        _fail(f"database error: {exc}", 1)


def _fail(message: str, code: int) -> None:
    # Redacted once more here: whatever path a URL took into a message, it is masked.
    # An error may quote data (a row's, a server's): its control characters are escaped.
    sys.stderr.write(f"outbox-relay: {printable(redact(message), keep_newlines=True)}\n")
    sys.exit(code)
