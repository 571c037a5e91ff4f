"""deploy/grafana/outbox-relay.json: a well-formed Grafana dashboard whose every query
names only series the relay serves; likewise every rule of deploy/prometheus/alerts.yml.

The served series are not listed by hand: the relay's own collector (relay.daemon.metrics) is
run against fakes, and every metric family it yields is turned into the series names
Prometheus stores for its type (a counter ``x`` is stored as ``x_total``, a histogram as
``x_bucket``/``x_sum``/``x_count``, ...). A metric added to or renamed in relay.daemon.metrics is
therefore what the dashboard is checked against.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from relay.core.model import PartId
from relay.daemon import metrics

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "outbox-relay.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

# The series Prometheus stores for a metric family of each type (exposition format).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "untyped": ("",),
    "unknown": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
}

_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip


class _Relay:
    """A relay running one part, with every counter and state it reports."""

    def healthy(self) -> tuple[bool, str]:
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        return True, "ok"

    def part_totals(self) -> dict[PartId, Counter[str]]:
        return {PartId("orders", 0): Counter({field: 1 for field in metrics._COUNTERS})}

    def part_states(self) -> dict[PartId, str]:
        return {PartId("orders", 0): "running"}

    def part_waits(self) -> dict[PartId, str]:
        return {PartId("orders", 0): "schema_registry"}

    def key_space_changes(self) -> Counter[str]:
        return Counter({"rebased": 1})

    def retention_totals(self) -> Counter[str]:
        return Counter({"pruned": 1, "failed": 1})


class _Store:
    closed = False

    def sees_all_backends(self) -> bool:
        return True  # so the horizon's age is served too

    def horizon_holders(self) -> list[Any]:
        return [SimpleNamespace(age_s=3.0)]

    def live_sessions(self) -> list[Any]:
        return [object()]

    def close(self) -> None:
        pass


def _statuses(store: Any) -> list[Any]:
    part = SimpleNamespace(
        state=SimpleNamespace(
            name="orders", part=0, updated_at=datetime.now(UTC), owner="me", halted_error=None
        ),
        lag=SimpleNamespace(events=1, seconds=1.0),
    )
    return [SimpleNamespace(parts=[part])]


@pytest.fixture(scope="module")
def served() -> set[str]:
    """Every series name the relay's /metrics can serve, from its own collector."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "subscriber_statuses", _statuses)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics.RelayCollector(_Relay(), _Store))  # type: ignore[arg-type]
        families = list(registry.collect())
    names = set()
    for family in families:
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    assert any(n.startswith("outbox_relay_lag") for n in names), names
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, aggregations, keywords,
    label names and Grafana's $variables left out)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that shows data, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    queries = [
        (f"panel {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in _panels(dashboard)
        for target in panel["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            # Grafana's label_values(METRIC, LABEL): the metric is a selector.
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", text.strip())
            queries.append((f"variable {variable['name']}", match.group(1) if match else text))
    return queries


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(source) == 1 and source[0]["query"] == "prometheus", (
        "a Prometheus datasource variable"
    )
    uses = "${" + source[0]["name"] + "}"
    panels = _panels(dashboard)
    assert panels
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for r in dashboard["panels"] if r["type"] == "row" for p in r.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        where = f"panel {panel.get('title')!r}"
        assert panel["title"], where
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), where
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
        assert panel["datasource"]["uid"] == uses, f"{where}: not on the datasource variable"
        assert panel["targets"], f"{where}: no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), where
        for target in panel["targets"]:
            assert target["expr"].strip(), where
            assert target.get("datasource", panel["datasource"])["uid"] == uses, where
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uses, variable["name"]


def test_every_query_names_only_metrics_the_relay_serves(served: set[str]) -> None:
    queries = _queries(_dashboard())
    assert queries
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: selects no metric: {expr}"
        unknown = names - served
        assert not unknown, f"{where}: {sorted(unknown)} not served by the relay: {expr}"


def test_dashboard_shows_what_operators_watch() -> None:
    """Lag, throughput, commit-to-visible latency, halts and dead letters."""
    used = {name for _, expr in _queries(_dashboard()) for name in metric_names(expr)}
    for series in (
        "outbox_relay_lag_events",
        "outbox_relay_lag_seconds",
        "outbox_relay_published_events_total",
        "outbox_relay_part_halted",
        "outbox_relay_dead_lettered_events_total",
    ):
        assert series in used, series


def test_metric_names_reads_promql(served: set[str]) -> None:
    expr = (
        'sum by (subscriber, part) (rate(outbox_relay_published_events_total{subscriber=~"$s",'
        'part!="0"}[$__rate_interval])) / on(subscriber) group_left(part) '
        "max without (instance) (outbox_relay_lag_events offset 5m) > bool 0 or vector(0)"
    )
    assert metric_names(expr) == {
        "outbox_relay_published_events_total",
        "outbox_relay_lag_events",
    }
    # The suffix must fit the type: a gauge has no _total, a counter no bare name.
    assert "outbox_relay_lag_events" in served
    assert "outbox_relay_lag_events_total" not in served
    assert "outbox_relay_published_events" not in served
    assert "outbox_relay_published_events_bucket" not in served


def test_alert_rules_watch_only_metrics_the_relay_serves(served: set[str]) -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {"OutboxRelayPartHalted", "OutboxRelayWorkerFailed"} <= set(alerts)
    for name, rule in alerts.items():
        watched = metric_names(rule["expr"])
        assert watched, f"{name} watches no relay metric"
        assert watched <= served, f"{name}: {sorted(watched - served)}"
    assert "outbox_relay_part_halted" in alerts["OutboxRelayPartHalted"]["expr"]
