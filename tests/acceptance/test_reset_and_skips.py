"""Issue #28: resets that would skip events silently, what status and verify count apart
(events a reset skipped, records of before a reset or of pruned rows), and lag that
counts only the events a subscriber's filters match. The CLI as users run it."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import psycopg

from relay import Outbox
from relay.daemon import Relay
from tests.support import consume, run_cli, wait_caught_up, write_orders

INSERT = (
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT 'order', n::text, 'OrderPlaced', '{}' FROM generate_series(1, %s) AS n"
)


def _json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _checkpoint(db: psycopg.Connection[Any]) -> tuple[str, int, str, Any]:
    row = db.execute(
        "SELECT transaction_id::text, position, start_transaction_id::text, generation"
        " FROM outbox_checkpoints WHERE subscriber = 's'"
    ).fetchone()
    assert row is not None
    return row


def test_a_reset_beyond_the_horizon_is_refused_and_nothing_moves(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    assert run_cli("subscribers", "add", "s", "--topic", "s", env=env).returncode == 0
    before = _checkpoint(db)
    refused = run_cli("subscribers", "reset", "s", "--to", "999999999:0", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "beyond what the database has decided" in refused.stderr
    assert "never be published" in refused.stderr and "Traceback" not in refused.stderr
    assert _checkpoint(db) == before
    # Written after the refused reset: still counted as lag, so nothing hides it.
    db.execute(INSERT, (5,))
    [status] = _json(run_cli("subscribers", "list", "--json", env=env))
    assert (status["lag_events"], status["skipped_by_reset"]) == (5, 0)
    # The horizon itself (what 'now' takes) is allowed.
    [[horizon]] = db.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text").fetchall()
    at_horizon = ("subscribers", "reset", "s", "--to", f"{horizon}:0", "--yes")
    assert run_cli(*at_horizon, env=env).returncode == 0


def test_status_and_verify_count_what_a_reset_forward_skipped(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    topic = topic_prefix + "s"
    added = run_cli("subscribers", "add", "s", "--topic", topic, "--format", "json", env=env)
    assert added.returncode == 0, added.stderr
    db.execute(INSERT, (4,))
    assert run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env).returncode == 0
    # A second reset forward before anything was published: both ranges count.
    db.execute(INSERT, (2,))
    assert run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env).returncode == 0

    [part] = _json(run_cli("status", "--json", env=env))["parts"]
    assert (part["lag_events"], part["skipped_by_reset"], part["beyond_horizon"]) == (0, 6, False)
    table = run_cli("status", env={**env, "COLUMNS": "200"})
    assert "skipped by operator" in table.stdout
    [listed] = _json(run_cli("subscribers", "list", "--json", env=env))
    assert listed["skipped_by_reset"] == 6

    # Issue #48: skipped events are never passed for clean (exit 4: only those).
    verify = run_cli("verify", "--json", "--timeout", "20", env=env)
    assert verify.returncode == 4, verify.stderr
    [report] = json.loads(verify.stdout)
    assert (report["skipped_by_reset"], report["missing"], report["clean"]) == (6, 0, False)


def test_a_checkpoint_beyond_the_horizon_is_shown_and_is_a_finding(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    """As an older relay's reset left it: every row written since sorts before it."""
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    added = run_cli("subscribers", "add", "s", "--topic", topic_prefix + "s", env=env)
    assert added.returncode == 0, added.stderr
    db.execute(
        "UPDATE outbox_checkpoints SET transaction_id = '999999999', position = 0, "
        "start_transaction_id = '999999999', start_position = 0"
    )
    db.execute(INSERT, (5,))
    status = run_cli("status", env={**env, "COLUMNS": "250"})
    assert "BEYOND HORIZON" in status.stdout and "NEVER published" in status.stdout
    [part] = _json(run_cli("status", "--json", env=env))["parts"]
    assert (part["lag_events"], part["skipped_by_reset"]) == (0, 5)
    verify = run_cli("verify", "--json", "--timeout", "20", env=env)
    assert verify.returncode == 1 and verify.stdout, verify.stderr
    [report] = json.loads(verify.stdout)
    assert report["beyond_horizon"] == [0] and not report["clean"]
    assert report["skipped_by_reset"] == 5


def test_verify_tells_the_crash_window_from_before_a_reset_and_from_pruned_rows(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    outbox: Outbox,
    start_relay: Any,
) -> None:
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    topic = topic_prefix + "s"
    added = run_cli("subscribers", "add", "s", "--topic", topic, "--format", "json", env=env)
    assert added.returncode == 0, added.stderr
    write_orders(db, outbox, ["1", "2", "3", "4"])
    relay: Relay = start_relay()
    wait_caught_up(db, "s")
    relay.stop()
    assert len(consume(kafka_bootstrap, [topic], 4, quiet=0.2)) == 4
    # Two rows pruned, then a reset to now: the other two are before the new start.
    db.execute(
        "DELETE FROM outbox WHERE position IN "
        "(SELECT position FROM outbox ORDER BY position LIMIT 2)"
    )
    assert run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env).returncode == 0
    # The crash window: the checkpoint moved back under a published record.
    write_orders(db, outbox, ["5"])
    relay = start_relay()
    wait_caught_up(db, "s")
    relay.stop()
    db.execute(
        "UPDATE outbox_checkpoints SET transaction_id = start_transaction_id, "
        "position = start_position"
    )
    [report] = _json(run_cli("verify", "--json", "--timeout", "20", env=env))
    assert (report["ahead"], report["before_start"], report["not_in_outbox"]) == (1, 2, 2)
    assert report["clean"]


def test_lag_counts_only_the_events_a_subscribers_filters_match(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    for args in (
        ("invoices", "--aggregate-type", "invoice"),
        ("refunds", "--event-type", "RefundIssued"),
    ):
        added = run_cli("subscribers", "add", *args, "--topic", args[0], env=env)
        assert added.returncode == 0, added.stderr
    db.execute(INSERT, (251,))  # orders only: neither subscriber's
    lags = {
        p["part"]: p["lag_events"] for p in _json(run_cli("status", "--json", env=env))["parts"]
    }
    assert lags == {"invoices/0": 0, "refunds/0": 0}
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('invoice', '1', 'InvoiceSent', '{}'), ('invoice', '2', 'RefundIssued', '{}')"
    )
    listed = {
        s["name"]: s["lag_events"] for s in _json(run_cli("subscribers", "list", "--json", env=env))
    }
    assert listed == {"invoices": 2, "refunds": 1}


def test_status_runs_on_a_schema_from_before_migration_9(database_url: str) -> None:
    """A rolling deploy: this version's status on the previous schema."""
    from relay.adapters.postgres import migrations
    from relay.adapters.postgres.store import OutboxStore
    from relay.core.subscribers import Subscriber, ValueFormat

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=7)
        conn.execute(INSERT, (2,))
        # As a relay of this version creates one (the CLI's add needs the ledger, 0019).
        OutboxStore(conn).add(Subscriber("s", topic="s", value_format=ValueFormat.JSON))
    env = {"RELAY_DATABASE_URL": database_url}
    [part] = _json(run_cli("status", "--json", env=env))["parts"]
    assert (part["lag_events"], part["skipped_by_reset"]) == (2, 0)
