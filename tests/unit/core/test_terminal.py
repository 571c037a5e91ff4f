"""Issue #47, low: control characters in what the CLI and its logs print are escaped, on
every path (rich tables and Text, plain lines, errors, log lines); rich markup in data
prints literally. tests/acceptance/test_terminal_escapes.py runs the commands."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from rich.table import Table
from rich.text import Text

from relay import cli
from relay.cli.common import _Terminal, err, out, print_json
from relay.core.terminal import printable
from relay.errors import RelayError
from relay.observability.logs import RedactingFormatter

HOSTILE = "a\x1b]52;c;aGk=\x07b\x1b[2J\rc\x08\x7f\x9b\u202e\u2028[red]d[/red]\ne"
_RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u202e]")


def test_printable_escapes_every_control_character() -> None:
    plain = "plain text, ünïcode, emoji \U0001f600"
    assert printable(plain) == plain
    assert printable(HOSTILE) == (
        "a\\x1b]52;c;aGk=\\x07b\\x1b[2J\\rc\\x08\\x7f\\x9b\\u202e\\u2028[red]d[/red]\\ne"
    )
    assert printable("one\x1b\ntwo", keep_newlines=True) == "one\\x1b\ntwo"
    assert printable(printable(HOSTILE)) == printable(HOSTILE)


def _rendered(*objects: object) -> str:
    buffer = io.StringIO()
    # As the CLI's consoles are built, on a terminal: rich's own styles are ESC codes,
    # so they are stripped before looking for the data's.
    console = _Terminal(
        file=buffer, markup=False, emoji=False, highlight=False, width=300, force_terminal=True
    )
    for item in objects:
        console.print(item)
    return re.sub(r"\x1b\[[0-9;]*m", "", buffer.getvalue())


def test_the_cli_consoles_escape_strings_texts_and_table_cells() -> None:
    assert isinstance(out, _Terminal) and isinstance(err, _Terminal)
    table = Table("str cell", "Text cell")
    table.add_row(HOSTILE, Text(HOSTILE, style="red"))
    shown = _rendered(
        table, HOSTILE, Text.assemble(("label: ", "bold red"), HOSTILE), f"line {HOSTILE}"
    )
    assert not _RAW.findall(shown), shown
    assert "\\x1b]52;c;aGk=\\x07b\\x1b[2J" in shown
    assert "[red]d[/red]" in shown  # markup in data prints literally


def test_an_escaped_text_keeps_its_styles_on_its_characters() -> None:
    buffer = io.StringIO()
    console = _Terminal(file=buffer, width=80, force_terminal=True, color_system="standard")
    console.print(Text.assemble(("x\x1by", "red"), " plain"))
    assert buffer.getvalue() == "\x1b[31mx\\x1by\x1b[0m plain\n"


def test_json_output_escapes_control_characters_del_included(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_json({"event_type": HOSTILE})
    printed = capsys.readouterr().out
    assert not _RAW.findall(printed.replace("\n", "")), printed


def test_an_error_quoting_data_is_printed_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(**_: object) -> None:
        raise RelayError(f"first line {HOSTILE}\nsecond line")

    monkeypatch.setattr(cli, "app", fail)
    with pytest.raises(SystemExit):
        cli.main()
    printed = capsys.readouterr().err
    assert not _RAW.findall(printed.replace("\n", "")), printed
    assert printed.count("\n") == 3  # its own lines kept, the data's escaped


def test_log_lines_escape_messages_and_keep_traceback_lines() -> None:
    formatter = RedactingFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "poison: %s", (HOSTILE,), None)
    assert formatter.format(record) == f"WARNING poison: {printable(HOSTILE)}"
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    lines = formatter.format(failed).split("\n")
    assert lines[0] == "ERROR failed" and lines[1] == "Traceback (most recent call last):"
    assert not any(_RAW.findall(line) for line in lines)
