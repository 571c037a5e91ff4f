"""deploy/prometheus/alerts.yml tells the operator what to do: each alert's annotations say
it, and its `runbook` names its section of deploy/README.md; and each alert has a unit
test in alerts.test.yml that fires it (tests/acceptance/test_alert_rules.py runs them
with promtool)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS = REPO / "deploy" / "prometheus"
README = REPO / "deploy" / "README.md"


def _alerts() -> dict[str, dict[str, Any]]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _alert_sections() -> dict[str, str]:
    """The anchors of deploy/README.md's "Alerts" section and its subsections -> their text."""
    section = README.read_text().split("\n### Alerts\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^#### (.+)$", section, flags=re.MULTILINE)
    return {_slug(heading): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_alert_says_what_to_do_and_where_its_runbook_is() -> None:
    sections = _alert_sections()
    for name, rule in _alerts().items():
        notes = rule.get("annotations", {})
        assert notes.get("summary") and notes.get("description"), name
        assert rule["labels"]["severity"] in {"page", "warn"}, name
        path, _, anchor = notes.get("runbook", "").partition("#")
        assert path == "deploy/README.md" and anchor == _slug(name), f"{name}: {notes}"
        assert anchor in sections, f"{name}: no '#### {name}' under '### Alerts' in {README}"
        assert f"`{rule['labels']['severity']}`" in sections[anchor], f"{name}: its severity"


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    fired = {
        match.group(1)
        for group in tests["tests"]
        for case in group.get("promql_expr_test", [])
        for sample in case.get("exp_samples") or []
        if (match := re.search(r'alertname="(\w+)",alertstate="firing"', sample["labels"]))
    }
    assert set(_alerts()) <= fired, f"no test fires {sorted(set(_alerts()) - fired)}"
