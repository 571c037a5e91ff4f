"""What the commands that change what a subscriber publishes share: who acts (for the
ledger), the gate of those that skip or republish events (``--dry-run``, ``--yes``,
or a question on a terminal), and how the ledger and the operator's skips print."""

from __future__ import annotations

import getpass
import socket
import sys
from collections.abc import Iterable
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from relay.cli.common import err, out
from relay.core.interventions import Actor, OperatorSkip, Recorded
from relay.ops.interventions import Confirm, Preview

# The gate's exit code when it refuses for want of --yes (as a usage error): nothing changed.
REFUSED = 2

DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print how many events it would skip or republish (and which); change nothing.",
    ),
]
BatchSize = Annotated[int, typer.Option(min=1, max=10_000, help="Events per Kafka transaction.")]
Yes = Annotated[
    bool,
    typer.Option(
        "--yes", "-y", help="Go ahead without asking (needed without a terminal: scripts, CI)."
    ),
]


def actor() -> Actor:
    """Who runs this command, as the ledger records it beside the database role."""
    try:
        user: str | None = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = None
    return Actor(user, socket.gethostname() or None)


def gate(*, dry_run: bool, yes: bool, machine_output: bool = False) -> Confirm:
    """The gate of a command that skips or republishes events: it prints the preview,
    then goes ahead with ``--yes``, asks on a terminal, and otherwise refuses (exit 2)
    with nothing changed. ``--dry-run`` prints the preview only. ``machine_output``: the
    command prints JSON on stdout, so the preview goes to stderr."""
    console = err if machine_output else out

    def confirm(preview: Preview) -> bool:
        console.print(Text(preview.summary, style="bold"))
        for line in preview.lines:
            console.print(f"  {line}")
        if dry_run:
            console.print("dry run: nothing changed")
            return False
        if yes:
            return True
        if not sys.stdin.isatty():
            err.print(
                Text(f"refused: `{preview.action}` changes what is published, and with no "
                     "terminal to confirm on it needs --yes; nothing changed (--dry-run "
                     "previews it)", style="red")
            )  # fmt: skip
            raise typer.Exit(REFUSED)
        if not typer.confirm("Go ahead?", default=False):
            err.print("nothing changed")
            raise typer.Exit(1)
        return True

    return confirm


def print_ledger(entries: Iterable[Recorded]) -> None:
    table = Table("#", "when", "who", "action", "events", "what")
    for e in entries:
        table.add_row(
            str(e.id), f"{e.recorded_at:%Y-%m-%d %H:%M:%S %Z}", e.who, e.action.value,
            "-" if e.events is None else str(e.events), _what(e.params),
        )  # fmt: skip
    out.print(table)


def _what(params: dict[str, object]) -> str:
    """An entry's parameters, one ``key=value`` each (lists and objects as given)."""
    return "; ".join(f"{k}={v}" for k, v in params.items())


def print_operator_skips(name: str, skips: Iterable[OperatorSkip]) -> None:
    """Every skip of ``name`` with its ledger entry: never passed for a clean, caught-up
    subscriber (issue #48)."""
    listed = list(skips)
    for skip in listed:
        out.print(f"{name}: {skip.describe()}")
    if listed:
        out.print(f"({name}: `outbox-relay subscribers history {name}` lists every intervention)")
