"""Structured log fields in one place (#34 item 4): every log line of relay/ and
spark_jobs/ carries a stable event name, built by ``relay.core.log_fields.log_extra`` (or a
helper of its context that calls it) rather than a dict made by hand, so operators can
filter on ``event`` and on the context's fields (``part``, ``session``, ...)."""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path
from uuid import UUID

import pytest

from relay.core.log_fields import log_extra
from relay.core.model import PartId, Position
from relay.observability.logs import JsonFormatter

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("relay", "spark_jobs")
# The one event style: snake_case. These two are dotted but stay: docs/configuration.md and
# deploy/prometheus/alerts.yml name them, and operators' filters may match them.
DOCUMENTED_DOTTED = {"registry.unreachable", "registry.reachable"}
_SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
# A field named like a LogRecord attribute makes logging raise KeyError for the line (a
# relay declaring a subscriber in its config once crashed at start on "created").
_RECORD_ATTRIBUTES = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
_LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _in_scope() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _loggers(tree: ast.Module) -> set[str]:
    """The module-level names bound to ``logging.getLogger(...)``, and ``logging``
    itself (a call on the root logger is a log line too)."""
    found = {"logging"}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "logging.getLogger"
        ):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return found


def _log_calls(tree: ast.Module) -> list[ast.Call]:
    loggers = _loggers(tree)
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _LEVELS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in loggers
    ]


def _fault(call: ast.Call) -> str | None:
    """What is wrong with a log call's ``extra``, or None."""
    if any(k.arg is None for k in call.keywords):
        return "keywords passed as **"
    extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
    if extra is None:
        return "no extra"
    if not (isinstance(extra, ast.Call) and ast.unparse(extra.func).endswith("log_extra")):
        return "extra not built by a log_extra helper"
    event = extra.args[0] if extra.args else None
    if not (isinstance(event, ast.Constant) and isinstance(event.value, str)):
        return "no constant event name"
    if not _SNAKE.fullmatch(event.value) and event.value not in DOCUMENTED_DOTTED:
        return f"event {event.value!r} is not snake_case"
    clashing = sorted(k.arg for k in extra.keywords if k.arg in _RECORD_ATTRIBUTES)
    if clashing:
        return f"fields {clashing} are LogRecord attributes"
    return None


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", _in_scope(), ids=_rel)
def test_every_log_line_names_its_event_through_the_helper(path: Path) -> None:
    calls = _log_calls(ast.parse(path.read_text()))
    faults = [f"{_rel(path)}:{c.lineno}: {f}" for c in calls if (f := _fault(c)) is not None]
    assert faults == []


def test_the_check_sees_the_log_lines() -> None:
    """The scan finds the calls it checks: on loggers named either way, in every
    package, and a hand-built dict is reported."""
    per_module = {_rel(p): len(_log_calls(ast.parse(p.read_text()))) for p in _in_scope()}
    assert (
        per_module["relay/engine/worker.py"] > 0
        and per_module["relay/adapters/registry/registry_format.py"] > 0
    )
    assert sum(n for m, n in per_module.items() if m.startswith("spark_jobs/")) > 0
    source = (
        "_log = logging.getLogger(__name__)\n"
        '_log.info("x", extra={"event": "a_b"})\n'
        '_log.info("x", extra=log_extra("registry.schema_id"))\n'
        '_log.info("x")\n'
        '_log.info("x", extra=log_extra("a_b", created=True))\n'
    )
    assert [_fault(c) for c in _log_calls(ast.parse(source))] == [
        "extra not built by a log_extra helper",
        "event 'registry.schema_id' is not snake_case",
        "no extra",
        "fields ['created'] are LogRecord attributes",
    ]


def test_the_context_helpers_go_through_log_extra() -> None:
    """A context's helper (``PartWorker._log_extra``, ...) adds its fields and calls
    ``log_extra``: the fields are still made one way."""
    helpers = [
        (path, node)
        for path in _in_scope()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.endswith("log_extra")
    ]
    assert len(helpers) >= 2
    by_hand = [
        f"{_rel(path)}:{node.lineno}"
        for path, node in helpers
        if _rel(path) != "relay/core/log_fields.py"
        and not any(
            isinstance(n, ast.Call) and ast.unparse(n.func) == "log_extra" for n in ast.walk(node)
        )
    ]
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
    record = logging.LogRecord("relay.engine.worker", logging.INFO, "", 0, "claimed", None, None)
    record.__dict__.update(log_extra("part_claimed", part=PartId("orders", 0)))
    line = json.loads(JsonFormatter().format(record))
    assert (line["event"], line["part"]) == ("part_claimed", str(PartId("orders", 0)))
