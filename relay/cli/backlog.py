"""How a backlog prints, in ``status`` and ``subscribers list``: a lag in events, the
events the operator skipped, and the notes that explain their marks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from rich.text import Text

from relay.cli.common import out
from relay.ops.lag import EXACT_UP_TO, Lag, Skipped


class SkipLine(NamedTuple):
    """What :func:`print_skips` names: a part or subscriber, its checkpoint, its skips."""

    name: str
    checkpoint: str
    skipped: Skipped


def events(lag: Lag) -> str:
    """A lag in events as printed: ``~`` marks an estimate."""
    return f"~{lag.events}" if lag.estimated else str(lag.events)


def print_estimate_note(lags: Iterable[Lag]) -> None:
    if any(lag.estimated for lag in lags):
        out.print(
            f"~: an estimate (past {EXACT_UP_TO} events behind, a part's lag is estimated "
            "from the outbox's positions, not counted)"
        )


def skipped(skips: Skipped) -> str:
    """Events the operator skipped, as printed: ``+`` marks a lower bound."""
    return f"{skips.events}{'+' if skips.at_least else ''}"


def print_skips(lines: list[SkipLine]) -> None:
    """Events the operator skipped, or a checkpoint no row can reach, must not pass for
    a caught-up subscriber (issues #28, #48)."""
    for line in lines:
        if line.skipped.beyond_horizon:
            out.print(
                Text(f"{line.name}: its checkpoint {line.checkpoint} is beyond what the "
                     "database has decided: every event written now sorts before it and is "
                     "NEVER published (counted as skipped by operator); reset it to 'now' or "
                     "to a point below the horizon", style="bold red")
            )  # fmt: skip
    if any(line.skipped.events for line in lines):
        out.print(
            "skipped by operator: events every `subscribers reset` forward jumped over and "
            f"every `subscribers skip` skipped (+: counted over the first {EXACT_UP_TO} rows "
            "only); they are not published"
        )
