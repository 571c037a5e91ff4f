"""Text made safe for an operator's terminal.

What the CLI and the logs print comes largely from data others control: event and
aggregate types, payloads and error texts from writers, application names of other
database sessions, a schema registry's answers. A terminal obeys the control characters
in it: ESC sequences clear the screen, retitle the window, write the clipboard (OSC 52)
or hide a link behind harmless text (OSC 8); a CR or a backspace overwrites what was
printed; bidirectional overrides reorder it. :func:`printable` shows each such character
as its escape instead (``\\x1b``, ``\\r``, ``\\u202e``), so it is seen and never obeyed.
"""

from __future__ import annotations


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every character Python does not call printable (C0 and C1 controls,
    DEL, format characters such as bidirectional overrides, line separators, unassigned
    code points) written as its backslash escape. With ``keep_newlines``, ``\\n`` stays
    (an error message of several lines); a log line or a table cell keeps none."""
    if text.isprintable():
        return text
    if keep_newlines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(character: str) -> str:
    return character.encode("unicode_escape").decode("ascii")
