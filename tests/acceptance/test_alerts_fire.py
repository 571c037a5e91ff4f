"""Issue #48, item 9: the alerts deploy/README.md promises fire on what a live relay
serves when their cause happens: a dead letter, a failed retention pass (the relay's
role lost EXECUTE on outbox_prune), figures from Postgres going stale. The relay's
scrapes, before and after, are fed to the shipped rule under promtool (Prometheus's own
engine) with their real names and labels, held as long as the rule's `for` asks."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from relay import Outbox
from relay.daemon import Relay
from tests.acceptance.test_observability import get, sample
from tests.plugins.promtool import run_promtool
from tests.support import sub, wait_caught_up, wait_until, write_orders
from tests.unit.deploy.test_grafana_dashboard import metric_names

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
EVERY_S = 15  # the scrape and evaluation interval the scrapes are fed at

# The first use builds promtool (tests/plugins/promtool.py): minutes on a busy machine.
pytestmark = pytest.mark.timeout(1800)


def _rule(alert: str) -> dict[str, Any]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    return rule


def _seconds(duration: str) -> int:
    return sum(
        int(n) * {"s": 1, "m": 60, "h": 3600}[unit]
        for n, unit in re.findall(r"(\d+)([smh])", duration)
    )


def _series(alert: str, scrapes: list[str]) -> list[dict[str, str]]:
    """promtool's input series: the alert's metrics as the scrapes served them, one value
    per scrape, the last held for the rule's `for` and one interval more."""
    watched = metric_names(_rule(alert)["expr"])
    hold = _seconds(_rule(alert).get("for", "0s")) // EVERY_S + 1
    values: dict[str, list[str]] = {}
    for i, text in enumerate(scrapes):
        for family in text_string_to_metric_families(text):
            for s in (s for s in family.samples if s.name in watched):
                labels = ",".join(
                    f'{k}="{v}"' for k, v in sorted({**s.labels, "instance": "relay-0"}.items())
                )
                shown = "Inf" if math.isinf(s.value) else repr(s.value)
                values.setdefault(f"{s.name}{{{labels}}}", ["_"] * len(scrapes))[i] = shown
    assert values, f"the scrapes serve none of {watched}"
    return [{"series": k, "values": " ".join(v + [v[-1]] * hold)} for k, v in values.items()]


def _fires(promtool: Path, tmp_path: Path, alert: str, scrapes: list[str]) -> bool:
    """Whether the shipped rule fires at the end of ``scrapes`` (held, see _series)."""
    series = _series(alert, scrapes)
    end = (len(series[0]["values"].split()) - 1) * EVERY_S
    test = {
        "rule_files": [str(PROMETHEUS / "alerts.yml")],
        "evaluation_interval": f"{EVERY_S}s",
        "tests": [
            {
                "interval": f"{EVERY_S}s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f'count(ALERTS{{alertname="{alert}",alertstate="firing"}}) >bool 0',
                        "eval_time": f"{end}s",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                ],
            }
        ],
    }
    path = tmp_path / f"{alert}.test.yml"
    path.write_text(yaml.safe_dump(test))
    tested = run_promtool(promtool, "test", "rules", path)
    said = tested.stdout + tested.stderr
    # Not firing is a failed expectation, never a rule or series promtool refused.
    assert tested.returncode == 0 or ("exp:" in said and "got:" in said), said
    return tested.returncode == 0


def _scrape(relay: Relay) -> str:
    status, text = get(relay, "/metrics")
    assert status == 200
    return text


def test_a_dead_letter_fires_its_alert(
    promtool: Path,
    tmp_path: Path,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """Avro, on_poison = "dead-letter": an event type with no schema is dead-lettered,
    the part goes on, and the page says so (nothing did before)."""
    dead_letters = sub(
        "dl", topic_prefix, on_poison="dead-letter", dead_letter_topic=topic_prefix + "dead"
    )
    relay = start_relay(subscribers=[dead_letters], metrics_cache_ttl=0)
    write_orders(writer_db, outbox, ["o-1"])
    wait_caught_up(db, "dl")
    before = _scrape(relay)
    counted = "outbox_relay_dead_lettered_events_total"
    assert sample(before, counted, subscriber="dl", part="0") == 0
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', 'x', 'NoSuchSchema', '{}')"
    )
    write_orders(writer_db, outbox, ["o-2"])
    wait_caught_up(db, "dl")
    after = _scrape(relay)
    assert sample(after, counted, subscriber="dl", part="0") == 1
    assert not _fires(promtool, tmp_path, "OutboxRelayDeadLettered", [before, before])
    assert _fires(promtool, tmp_path, "OutboxRelayDeadLettered", [before, after])


def test_a_failed_retention_pass_fires_its_alert(
    promtool: Path,
    tmp_path: Path,
    db: psycopg.Connection[Any],
    relay_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """The relay's role loses EXECUTE on outbox_prune (an upgrade's `grant` not run, a
    revoke): retention fails, published rows are kept, and the warning says so."""
    relay = start_relay(subscribers=[sub("s", topic_prefix)], prune_every=0.5, retention=0)
    before = _scrape(relay)
    assert sample(before, "outbox_relay_prune_failures_total") == 0
    role = sql.Identifier(urlsplit(relay_url).username or "")
    db.execute(
        sql.SQL("REVOKE EXECUTE ON FUNCTION outbox_prune(float8, integer) FROM {}").format(role)
    )
    wait_until(lambda: relay.retention_totals()["failures"] >= 1, what="a failed retention pass")
    after = _scrape(relay)
    assert (sample(after, "outbox_relay_prune_failures_total") or 0) >= 1
    assert not _fires(promtool, tmp_path, "OutboxRelayPruneFailing", [before, before])
    assert _fires(promtool, tmp_path, "OutboxRelayPruneFailing", [before, after])


def test_figures_from_postgres_going_stale_raise_the_age_its_alert_watches(
    db: psycopg.Connection[Any],
    database_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """While the relay cannot read Postgres (here a lock its reads give up on), /metrics
    serves the last figures read, and their age grows with the time since: the gauge
    OutboxRelayDatabaseMetricsStale compares with its threshold (minutes, which
    alerts.test.yml crosses). A read that succeeds again brings it back down."""
    rule = _rule("OutboxRelayDatabaseMetricsStale")
    age = "outbox_relay_database_metrics_age_seconds"
    assert metric_names(rule["expr"]) == {age}
    relay = start_relay(
        subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0, database_lock_timeout=0.2
    )
    assert sample(_scrape(relay), "outbox_relay_lag_events", subscriber="s", part="0") == 0
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        locked_at = time.monotonic()
        time.sleep(2)
        held = time.monotonic() - locked_at
        stale = sample(_scrape(relay), age)
        # The last read that succeeded came before the lock: the figures are older.
        assert stale is not None and stale >= held, (stale, held)
        later = sample(_scrape(relay), age)
        assert later is not None and later > stale
        locker.rollback()

    def read_again() -> bool:
        now = sample(_scrape(relay), age)
        return now is not None and now < held

    wait_until(read_again, what="a read of Postgres to succeed again")
