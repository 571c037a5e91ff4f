"""/metrics, /healthz and /readyz of a running relay."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import psycopg

from relay import Outbox
from relay.daemon import Relay
from relay.store import OutboxStore
from tests.support import run_cli, sub, wait_caught_up, write_orders


def get(relay: Relay, path: str) -> tuple[int, str]:
    assert relay._http is not None
    url = f"http://127.0.0.1:{relay._http.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sample(metrics: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_health_and_readiness(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    write_orders(db, outbox, ["o-1", "o-2", "o-3"])
    wait_caught_up(db, "s")

    assert get(relay, "/healthz")[0] == 200
    status, why = get(relay, "/readyz")
    assert status == 200 and "ready" in why

    # An open transaction holding an xid holds back the publication horizon.
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT pg_current_xact_id()")
        time.sleep(1.1)
        status, metrics = get(relay, "/metrics")
        holder.rollback()
    assert status == 200
    assert sample(metrics, "outbox_relay_published_events_total", subscriber="s", part="0") == 3
    assert (
        sample(metrics, "outbox_relay_published_bytes_total", subscriber="s", part="0") or 0
    ) > 0
    assert sample(metrics, "outbox_relay_lag_events", subscriber="s", part="0") == 0
    assert sample(metrics, "outbox_relay_part_claimed", subscriber="s", part="0") == 1
    assert sample(metrics, "outbox_relay_part_halted", subscriber="s", part="0") == 0
    assert sample(metrics, "outbox_relay_live_sessions") == 1
    assert (sample(metrics, "outbox_relay_horizon_held_seconds") or 0) >= 1.0
    assert get(relay, "/nope")[0] == 404

    relay.stop()


def test_status_shows_parts_sessions_and_who_holds_the_horizon(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    caplog: Any,
) -> None:
    import json
    import logging

    relay = start_relay(subscribers=[sub("s", topic_prefix, parts=2)], horizon_warn_after=0.5)
    write_orders(db, outbox, ["o-1"])
    with psycopg.connect(database_url, application_name="slow-batch-job") as holder:
        holder.execute("SELECT pg_current_xact_id()")
        write_orders(holder, outbox, ["o-2"])  # an event of the open transaction
        time.sleep(1.0)
        result = run_cli("status", "--json", env={"RELAY_DATABASE_URL": database_url})
        with caplog.at_level(logging.WARNING, logger="relay.daemon"):
            relay._report_stalled_horizon(OutboxStore(db))
        holder.rollback()
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(p["part"] for p in report["parts"]) == ["s/0", "s/1"]
    assert all(p["owner"] for p in report["parts"])
    assert len(report["sessions"]) == 1 and report["sessions"][0]["parts"] == 2
    [holder_row] = report["horizon_holders"]
    assert holder_row["application_name"] == "slow-batch-job" and holder_row["age_s"] >= 1.0
    assert "slow-batch-job" in caplog.text and "held back" in caplog.text
