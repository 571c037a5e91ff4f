"""Issue #50 item 4: `subscribers add` and `subscribers set` take the same options of a
definition, each declared once in relay/cli/subscribers.py (its flag, help and default
written in one place, not once per command), and each command is options -> one `ops`
call -> print."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import typer.main

from relay.cli import subscribers as cli

SOURCE = ast.parse(Path(cli.__file__).read_text())

# The options of a definition both commands take (`add` also takes --parts, fixed at
# creation; the connection options and --yes are the CLI's common ones).
DEFINITION = [
    "topic",
    "value_format",
    "aggregate_type",
    "event_type",
    "on_poison",
    "dead_letter_topic",
    "subject_strategy",
    "key",
    "partition_by",
    "partition_count",
    "placement",
    "key_format",
]


def _command_function(name: str) -> ast.FunctionDef:
    """The function the module registers as `subscribers NAME`."""
    for node in ast.walk(SOURCE):
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call)
            and ast.unparse(d.func) == "subscribers_app.command"
            and [ast.literal_eval(a) for a in d.args] == [name]
            for d in node.decorator_list
        ):
            return node
    raise AssertionError(f"no function registered as `subscribers {name}`")


def _declarations(option: str) -> int:
    """How many places of the module declare the option: a parameter of `add` or `set`
    named so, or a call naming it first (a table's row)."""
    parameters = [
        a.arg
        for command in ("add", "set")
        for a in (
            *_command_function(command).args.args,
            *_command_function(command).args.kwonlyargs,
        )
    ]
    rows = [
        node
        for node in ast.walk(SOURCE)
        if isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == option
    ]
    return parameters.count(option) + len(rows)


@pytest.mark.parametrize("option", DEFINITION)
def test_each_definition_option_is_declared_once(option: str) -> None:
    assert _declarations(option) == 1


def _options(command: str) -> dict[str, Any]:
    """The command's options as click holds them (typer's click may be its own copy,
    so they are not checked against `click`'s classes)."""
    group: Any = typer.main.get_command(cli.subscribers_app)
    return {p.name: p for p in group.commands[command].params}


def test_add_and_set_take_each_definition_option_alike() -> None:
    """Same flag, help and type; `add` shows the definition's default, `set` none (an
    option not given leaves the stored value)."""
    add, set_ = _options("add"), _options("set")
    for option in DEFINITION:
        a, s = add[option], set_[option]
        assert (a.opts, a.help, a.type_descriptor.annotation, a.multiple) == (
            s.opts,
            s.help,
            s.type_descriptor.annotation,
            s.multiple,
        ), option
        assert s.default is None, option
    with_default = {o for o in DEFINITION if add[o].default is not None}
    assert with_default == {"topic", "on_poison", "subject_strategy", "key", "key_format"}


@pytest.mark.parametrize("command", ["add", "set"])
def test_a_definition_command_makes_one_ops_call(command: str) -> None:
    calls = [
        node
        for node in ast.walk(_command_function(command))
        if isinstance(node, ast.Call) and "subscriber_ops." in ast.unparse(node.func)
    ]
    assert len(calls) == 1, [ast.unparse(c.func) for c in calls]
