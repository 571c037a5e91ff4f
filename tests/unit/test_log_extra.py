"""Structured log fields in one place (#34 item 4, for a part's lines): every log line of
the part worker and of the daemon's claims carries a stable event name and its part,
built by ``relay.log_fields.log_extra`` rather than a dict made by hand, so operators can
filter on ``event`` and ``part``."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path
from uuid import UUID

import pytest

import relay
from relay.log_fields import log_extra
from relay.logs import JsonFormatter
from relay.model import PartId, Position

# The modules whose every log line goes through log_extra.
ONE_PLACE = ["worker.py", "daemon/parts.py"]
_HELPERS = {"log_extra", "self._log_extra"}


def _log_calls(path: Path) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "logger"
    ]


@pytest.mark.parametrize("module", ONE_PLACE)
def test_every_log_line_names_its_event_through_the_helper(module: str) -> None:
    path = Path(relay.__file__).parent / module
    calls = _log_calls(path)
    assert calls
    by_hand = []
    for call in calls:
        extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
        helper = ast.unparse(extra.func) if isinstance(extra, ast.Call) else None
        event = extra.args[0] if isinstance(extra, ast.Call) and extra.args else None
        if helper not in _HELPERS or not isinstance(event, ast.Constant):
            by_hand.append(f"{module}:{call.lineno}")
    assert by_hand == []


def test_the_fields_are_logged_as_text_but_numbers() -> None:
    fields = log_extra(
        "part_retrying",
        part=PartId("orders", 3),
        checkpoint=Position(7, 2),
        message_id=UUID(int=1),
        retry_in=0.5,
        error=RuntimeError("boom"),
        previous=None,
    )
    assert fields == {
        "event": "part_retrying",
        "part": str(PartId("orders", 3)),
        "checkpoint": str(Position(7, 2)),
        "message_id": str(UUID(int=1)),
        "retry_in": 0.5,
        "error": "boom",
        "previous": None,
    }


def test_a_list_stays_a_list_of_plain_values() -> None:
    """A list of leaderless partitions is a JSON array, as before, not its text; a
    part, a tuple, is its text, inside a list too."""
    fields = log_extra("kafka_partitions_leaderless", partitions=["orders[1]", PartId("o", 0)])
    assert fields["partitions"] == ["orders[1]", str(PartId("o", 0))]


def test_a_json_log_line_carries_the_event_and_the_part() -> None:
    record = logging.LogRecord("relay.worker", logging.INFO, "", 0, "claimed", None, None)
    record.__dict__.update(log_extra("part_claimed", part=PartId("orders", 0)))
    line = json.loads(JsonFormatter().format(record))
    assert (line["event"], line["part"]) == ("part_claimed", str(PartId("orders", 0)))
