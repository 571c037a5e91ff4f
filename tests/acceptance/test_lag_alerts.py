"""Issue #47, medium 2: the lag and stall figures, and the alerts on them, come from time
the database observes, never from a time a writer chose. A hostile writer's row dated
2999 at the head of a backlog held outbox_relay_lag_seconds and
outbox_relay_publish_stalled_seconds at 0 while events waited behind a held
transaction; one dated 1970 made a backlog of seconds look 56 years old."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from relay import Outbox
from relay.daemon import Relay
from tests.acceptance.test_hostile_rows import insert
from tests.acceptance.test_observability import get, sample
from tests.support import order, run_cli, sub, wait_caught_up, wait_until, write_orders
from tests.unit.deploy.test_grafana_dashboard import metric_names

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
WAITING = 6  # events written behind the hostile row
# Issue #48, item 9: the signals deploy/README.md promises, each an alert on the series
# that carries it (a halted part, dead letters, prune failures, stale figures from
# Postgres, a stalled part).
SIGNALS = {
    "OutboxRelayPartHalted": {"outbox_relay_part_halted"},
    "OutboxRelayDeadLettered": {"outbox_relay_dead_lettered_events_total"},
    "OutboxRelayPruneFailing": {"outbox_relay_prune_failures_total"},
    "OutboxRelayDatabaseMetricsStale": {"outbox_relay_database_metrics_age_seconds"},
    "OutboxRelayPublishStalled": {"outbox_relay_publish_stalled_seconds"},
    "OutboxRelayCheckpointStuck": {
        "outbox_relay_lag_events",
        "outbox_relay_checkpoint_age_seconds",
    },
}


def _part_figures(relay: Relay) -> tuple[float | None, float | None, float | None]:
    """(lag in events, lag in seconds, stalled seconds) of part s/0 from a scrape."""
    metrics = get(relay, "/metrics")[1]
    return tuple(  # type: ignore[return-value]
        sample(metrics, name, subscriber="s", part="0")
        for name in (
            "outbox_relay_lag_events",
            "outbox_relay_lag_seconds",
            "outbox_relay_publish_stalled_seconds",
        )
    )


@pytest.mark.parametrize("dated", ["2999-01-01 00:00+00", "1970-01-01 00:00+00"])
def test_a_writers_occurred_at_neither_hides_nor_fakes_lag_and_stall(
    dated: str,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    writer_url: str,
    relay_url: str,
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    started = time.time()
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0)
    write_orders(writer_db, outbox, ["o-0"])
    wait_caught_up(db, "s")
    # A writer's open transaction (an xid, no row) holds every later event back...
    with psycopg.connect(writer_url) as holder:
        holder.execute("SELECT pg_current_xact_id()")
        # ...and behind it, the hostile row heads the backlog, then ordinary events.
        hostile = json.dumps(order("hostile"))
        insert(writer_db, "hostile", hostile, event_type="OrderPlaced", occurred_at=dated)
        write_orders(writer_db, outbox, [f"o-{i}" for i in range(1, WAITING + 1)])

        def risen() -> bool:
            events, lag_s, stalled = _part_figures(relay)
            return events == WAITING + 1 and (lag_s or 0) >= 2 and (stalled or 0) >= 2

        wait_until(risen, what="lag and stall to rise while events wait")
        # Time the database saw: never more than the test has run, whatever the row says.
        ran = time.time() - started + 1
        _, lag_s, stalled = _part_figures(relay)
        assert lag_s is not None and stalled is not None
        assert lag_s <= ran and stalled <= ran, (lag_s, stalled, ran)
        status = run_cli("status", "--json", env={"RELAY_DATABASE_URL": relay_url})
        assert status.returncode == 0, status.stderr
        [part] = json.loads(status.stdout)["parts"]
        assert part["lag_events"] == WAITING + 1
        assert 2 <= part["lag_seconds"] <= time.time() - started + 1, part
        holder.rollback()
    wait_caught_up(db, "s")


def test_a_writer_cannot_set_when_its_row_was_recorded(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any]
) -> None:
    """The writer role has no INSERT on recorded_at; a role with INSERT on every column
    (here the owner) gets the statement's time whatever it gives."""
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        insert(writer_db, "forged", "{}", recorded_at="2999-01-01 00:00+00")
    insert(db, "future", "{}", recorded_at="2999-01-01 00:00+00")
    insert(db, "past", "{}", recorded_at="1970-01-01 00:00+00")
    forged = db.execute(
        "SELECT aggregate_id FROM outbox"
        " WHERE recorded_at NOT BETWEEN now() - interval '1 hour' AND now()"
    ).fetchall()
    assert forged == []


def test_every_alert_rule_watches_series_a_live_relay_serves(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_reads_all_stats: None,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """tests/unit/deploy/test_grafana_dashboard.py checks the rules against the collector over
    fakes; this one against what a running relay serves, as Prometheus would scrape it
    (with pg_read_all_stats, which the horizon's series needs)."""
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0)
    write_orders(writer_db, outbox, ["o-1"])
    wait_caught_up(db, "s")
    families = list(text_string_to_metric_families(get(relay, "/metrics")[1]))
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert set(SIGNALS) <= set(alerts), f"no alert for {sorted(set(SIGNALS) - set(alerts))}"
    for name, expr in alerts.items():
        watched = metric_names(expr)
        assert watched and watched <= served, f"{name}: {sorted(watched - served)} not served"
    for name, series in SIGNALS.items():
        assert metric_names(alerts[name]) == series, name
