"""Issue #28, "Done means": the README's ops commands are run by a test, as written.

"The README" is README.md and the pages of docs/ it leads to, read in that order
(README.md, then docs/*.md by name). Every `outbox-relay` line of their ```bash blocks
whose command is one of the ops commands (subscribers, status, verify, dead-letters,
topics) runs against the relay's defaults, with only the database URL and the bootstrap
servers given, as the README says, through RELAY_DATABASE_URL and
RELAY_BOOTSTRAP_SERVERS. The README's
notation is expanded, not edited: `[X]` runs once without and once with X (`...`
dropped), `a | b` and `x|y` run each alternative. Placeholders in capitals
(TXID:POSITION) are the one thing left out: they name no value to type. Commands run
in the README's order, except `remove`, which runs last so that later blocks still
find the subscriber it removes. They run as the database owner: `subscribers add --parts
4` builds part indexes (tests/README.md, "Roles")."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support import REPO, fenced_blocks, run_cli

OPS = {"subscribers", "status", "verify", "dead-letters", "topics"}
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_:]*$")


def readme_pages() -> list[Path]:
    """README.md, then the pages of docs/ by name: the order their commands run in."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_lines() -> list[str]:
    """The `outbox-relay ...` lines of the README's pages' bash blocks, continuations
    joined."""
    lines: list[str] = []
    for page in readme_pages():
        for block in fenced_blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith("outbox-relay "):
                    lines.append(line)
    return lines


def _optional_groups(tokens: list[str]) -> list[list[str]]:
    """Without every `[...]` group, and with every one (its `...` dropped)."""
    without: list[str] = []
    with_all: list[str] = []
    depth = 0
    for token in tokens:
        opens, closes = token.startswith("["), token.endswith("]")
        word = token.removeprefix("[").removesuffix("]")
        depth += opens
        if word and word != "...":
            with_all.append(word)
            if depth == 0:
                without.append(word)
        depth -= closes
    return [without] if without == with_all else [without, with_all]


def _alternatives(tokens: list[str]) -> list[list[str]]:
    """`a b | c` as [a b], [prefix c]; each `x|y` token as one command per choice."""
    commands: list[list[str]] = []
    parts = [list(g) for bar, g in itertools.groupby(tokens, lambda t: t == "|") if not bar]
    first = parts[0]
    for part in parts:
        commands.append(part if part is first else first[: len(first) - len(part)] + part)
    expanded: list[list[str]] = []
    for command in commands:
        choices = [token.split("|") if "|" in token else [token] for token in command]
        for combination in itertools.product(*choices):
            if not any(_PLACEHOLDER.match(word) for word in combination):
                expanded.append(list(combination))
    return expanded


def ops_commands() -> list[list[str]]:
    """The README's ops commands, expanded, in the order the test runs them."""
    commands: list[list[str]] = []
    for line in readme_lines():
        tokens = shlex.split(line, comments=True)
        if tokens[1] not in OPS or "--through" in tokens:
            continue  # verify --through needs a Spark archive: test_spark_jobs.py runs it
        for variant in _optional_groups(tokens):
            commands.extend(c[1:] for c in _alternatives(variant))
    removals = [c for c in commands if c[:2] == ["subscribers", "remove"]]
    return [c for c in commands if c not in removals] + removals


def test_the_expansion_reads_the_readme_as_written() -> None:
    commands = [" ".join(c) for c in ops_commands()]
    for expected in (
        "subscribers pause billing",
        "subscribers resume billing",
        "subscribers reset billing --to now --yes",
        "subscribers reset billing --to beginning --dry-run --yes",
        "subscribers history billing --json",
        "subscribers list --json",
        "dead-letters redrive orders --schemas-dir schemas --json --dry-run --yes",
        "dead-letters redrive orders --yes",
        "verify --subscriber billing --json --timeout 600",
        "status",
        "topics list --internal --json",
    ):
        assert expected in commands
    assert commands[-1] == "subscribers remove billing"
    assert not [c for c in commands if "TXID" in c or "[" in c or "|" in c]


@pytest.mark.timeout(900)  # some 25 CLI processes, one after another, on 2 busy cores
def test_the_readmes_ops_commands_run_as_written(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    failed = []
    for command in ops_commands():
        done = run_cli(*command, env=env, timeout=300)
        if done.returncode != 0:
            failed.append(
                f"outbox-relay {' '.join(command)}: exit {done.returncode}\n{done.stderr}"
            )
    assert not failed, "\n".join(failed)
    listed = run_cli("subscribers", "list", "--json", env=env)
    orders, tenants = json.loads(listed.stdout)
    assert orders["name"] == "orders"
    # The routing example as the README writes it.
    assert (tenants["name"], tenants["key"], tenants["partition_by"]) == (
        "tenants",
        "{payload.tenant}",
        "headers.shard",
    )
    assert tenants["placements"] == ["occurred_at:header:at", "event_type:envelope"]
    assert tenants["partition_count"] == 3
