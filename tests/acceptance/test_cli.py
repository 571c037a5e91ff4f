"""The outbox-relay command as users run it: a real process, real Postgres and broker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from relay import Outbox
from tests.support import consume, grant_test_roles, run_cli, wait_until

EXE = [sys.executable, "-m", "relay.cli"]
REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env, timeout=60)


def test_run_publishes_and_exits_zero_on_sigterm(
    database_url: str, kafka_bootstrap: str, topic_prefix: str, outbox: Outbox
) -> None:
    assert cli("migrate", "--database-url", database_url).returncode == 0  # the owner
    roles = grant_test_roles(database_url)
    added = cli(
        "subscribers",
        "add",
        "cli",
        "--topic",
        topic_prefix + "{event_type}",
        "--format",
        "json",
        "--database-url",
        roles.relay_url,
    )
    assert added.returncode == 0, added.stderr
    with psycopg.connect(roles.writer_url) as conn:
        outbox.append(
            conn,
            aggregate_type="customer",
            aggregate_id="c-1",
            event_type="CustomerRegistered",
            payload={"customer_id": "c-1", "email": "a@b.c"},
        )
    env = {"RELAY_DATABASE_URL": roles.relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    relay = subprocess.Popen(
        [*EXE, "run"], cwd=REPO, env={**os.environ, **env}, stderr=subprocess.PIPE, text=True
    )
    try:
        [record] = consume(kafka_bootstrap, [topic_prefix + "CustomerRegistered"], 1, quiet=0.2)
        assert json.loads(record.value) == {"customer_id": "c-1", "email": "a@b.c"}
    finally:
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=30)
    assert relay.returncode == 0, stderr
    listed = json.loads(
        cli("subscribers", "list", "--json", "--database-url", roles.relay_url).stdout
    )
    assert [(s["name"], s["lag_events"]) for s in listed] == [("cli", 0)]


def test_subscriber_commands_round_trip(relay_url: str) -> None:
    url = ["--database-url", relay_url]
    assert (
        cli(
            "subscribers", "add", "b", "--aggregate-type", "order", "--from", "now", *url
        ).returncode
        == 0
    )
    duplicate = cli("subscribers", "add", "b", *url)
    assert duplicate.returncode == 1 and "already exists" in duplicate.stderr
    assert cli("subscribers", "pause", "b", *url).returncode == 0
    assert cli("subscribers", "reset", "b", "--to", "5:7", "--yes", *url).returncode == 0
    [row] = json.loads(cli("subscribers", "list", "--json", *url).stdout)
    assert (row["paused"], row["checkpoint"], row["aggregate_types"]) == (True, "5:7", ["order"])
    bad = cli("subscribers", "reset", "b", "--to", "yesterday", "--yes", *url)
    assert bad.returncode == 2 and "TRANSACTION_ID:POSITION" in bad.stderr
    assert cli("subscribers", "remove", "b", *url).returncode == 0
    missing = cli("subscribers", "pause", "b", *url)
    assert missing.returncode == 1 and "no subscriber named 'b'" in missing.stderr


def test_bad_configuration_exits_2_naming_the_key() -> None:
    result = cli("run", env={"RELAY_BATCH_SIZE": "-3", "RELAY_DATABASE_URL": "postgresql://x/y"})
    assert result.returncode == 2
    assert "batch_size (RELAY_BATCH_SIZE)" in result.stderr
    missing = cli(
        "run", env={"RELAY_DATABASE_URL": "postgresql://x/y", "RELAY_BOOTSTRAP_SERVERS": ""}
    )
    assert missing.returncode == 2 and "bootstrap_servers" in missing.stderr


def test_run_against_an_unmigrated_database_says_what_to_do(
    database_url: str, kafka_bootstrap: str
) -> None:
    result = cli("run", "--database-url", database_url, "--bootstrap-servers", kafka_bootstrap)
    assert result.returncode == 1
    assert "outbox-relay migrate" in result.stderr


def test_unreachable_database_is_a_clear_error() -> None:
    port = 1  # nothing listens there
    result = cli(
        "subscribers", "list", "--database-url", f"postgresql://postgres@127.0.0.1:{port}/x"
    )
    assert result.returncode == 1
    assert "postgres is unavailable" in result.stderr and "Traceback" not in result.stderr


def test_a_mistyped_database_url_never_prints_the_password() -> None:
    url = "postgresq://user:SECRET@127.0.0.1:1/db"
    for args, env in (
        (("status", "--database-url", url), None),
        (("subscribers", "list"), {"RELAY_DATABASE_URL": url}),
        (("run", "--bootstrap-servers", "127.0.0.1:1"), {"RELAY_DATABASE_URL": url}),
    ):
        result = cli(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert "database_url" in result.stderr and "user:***@127.0.0.1" in result.stderr
        assert "SECRET" not in result.stderr + result.stdout
        assert "Traceback" not in result.stderr


def test_a_refused_connection_never_prints_the_password() -> None:
    for url in (
        "postgresql://user:SECRET@127.0.0.1:1/db",
        "host=127.0.0.1 port=1 dbname=db user=user password=SECRET",
    ):
        result = cli("status", "--database-url", url)
        assert result.returncode == 1
        assert "postgres is unavailable" in result.stderr
        assert "SECRET" not in result.stderr + result.stdout


def test_listings_print_writer_and_client_text_verbatim(
    db: psycopg.Connection[Any], database_url: str, relay_url: str, outbox: Outbox
) -> None:
    """Event types, aggregate types, halt errors and application names are data: text
    that looks like rich markup ([/], [bold]) is printed as is, never parsed."""
    url = ["--database-url", relay_url]
    added = cli(
        "subscribers", "add", "m", "--format", "json", "--aggregate-type", "[/]",
        "--event-type", "[bold]Placed", *url,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    db.execute(
        "UPDATE outbox_checkpoints SET halted_at = now(), halted_error = %s WHERE subscriber = 'm'",
        ("bad payload [/] in [bold]Placed[/bold]",),
    )
    wide = {"COLUMNS": "400"}
    listed = cli("subscribers", "list", *url, env=wide)
    assert listed.returncode == 0, listed.stderr
    assert "aggregate_types=[/]; event_types=[bold]Placed" in listed.stdout
    assert "m/0 halted: bad payload [/] in [bold]Placed[/bold]" in listed.stderr
    with psycopg.connect(database_url, application_name="[/] [bold]etl") as holder:
        holder.execute("SELECT pg_current_xact_id()")
        status = cli("status", *url, env=wide)
        holder.rollback()
    assert status.returncode == 0, status.stderr
    assert "[/] [bold]etl" in status.stdout


def test_verify_tells_findings_from_could_not_check(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
) -> None:
    from relay.localstack import free_port

    assert run_cli("subscribers", "add", "s", env={"RELAY_DATABASE_URL": relay_url}).returncode == 0
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', '1', 'OrderPlaced', '{}')"
    )
    db.execute("UPDATE outbox_checkpoints SET transaction_id = '999999999', position = 1")
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    findings = run_cli("verify", "--timeout", "20", env=env)
    assert findings.returncode == 1, findings.stderr  # the event is missing from Kafka
    broker_down = run_cli(
        "verify",
        "--timeout",
        "5",
        env={**env, "RELAY_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"},
    )
    assert broker_down.returncode == 3, broker_down.stderr
    assert "could not check" in broker_down.stderr
    db_down = run_cli(
        "verify", env={**env, "RELAY_DATABASE_URL": f"postgresql://x@127.0.0.1:{free_port()}/x"}
    )
    assert db_down.returncode == 3 and "could not check" in db_down.stderr


def test_verify_says_when_a_reset_narrowed_its_check(relay_url: str, kafka_bootstrap: str) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    assert (
        run_cli("subscribers", "add", "s", "--topic", "v.{aggregate_type}", env=env).returncode == 0
    )
    assert run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env).returncode == 0
    result = run_cli("verify", env=env)
    assert result.returncode == 0, result.stderr
    assert "s: checked only events after part 0 at" in result.stderr
    [report] = json.loads(run_cli("verify", "--json", env=env).stdout)
    assert len(report["checked_after"]) == 1


def test_status_before_any_relay_says_what_to_do(relay_url: str) -> None:
    result = run_cli("status", env={"RELAY_DATABASE_URL": relay_url})
    assert result.returncode == 0
    assert "`outbox-relay run` creates the default subscriber" in result.stdout


def test_piped_tables_keep_long_values_whole(relay_url: str) -> None:
    topic = "a-rather-long-topic-prefix.for-a-team-with-long-names.outbox.event.{aggregate_type}"
    env = {"RELAY_DATABASE_URL": relay_url}
    assert run_cli("subscribers", "add", "s", "--topic", topic, env=env).returncode == 0
    listing = run_cli("subscribers", "list", env={**env, "COLUMNS": ""})
    assert topic in listing.stdout


def test_status_counts_a_small_lag_and_estimates_a_huge_one(
    writer_db: psycopg.Connection[Any], database_url: str, relay_url: str
) -> None:
    """A lag is counted exactly up to 10,000 events; beyond, it is estimated from the
    outbox's positions (no count over the backlog) and shown as one."""
    env = {"RELAY_DATABASE_URL": relay_url, "COLUMNS": "200"}
    owner = {**env, "RELAY_DATABASE_URL": database_url}  # it builds the part indexes
    for name, parts in (("one", "1"), ("two", "2")):
        added = run_cli("subscribers", "add", name, "--topic", name, "--parts", parts, env=owner)
        assert added.returncode == 0, added.stderr
    insert = (
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', n::text, 'OrderPlaced', '{}' FROM generate_series(1, %s) AS n"
    )
    writer_db.execute(insert, (3,))
    small = _lags(run_cli("status", "--json", env=env))
    assert small["one/0"] == (3, False)
    assert small["two/0"][0] + small["two/1"][0] == 3 and not small["two/0"][1]

    writer_db.execute(insert, (12_000,))
    huge = _lags(run_cli("status", "--json", env=env))
    assert huge["one/0"] == (12_003, True)  # no gaps in the positions: the estimate is exact
    split = huge["two/0"][0] + huge["two/1"][0]
    assert abs(split - 12_003) <= 2 and huge["two/0"][1] and huge["two/1"][1]
    table = run_cli("status", env=env).stdout
    assert "~12003" in table and "~: an estimate" in table
    listed = json.loads(run_cli("subscribers", "list", "--json", env=env).stdout)
    one = next(s for s in listed if s["name"] == "one")
    assert (one["lag_events"], one["lag_estimated"]) == (12_003, True)


def _lags(result: subprocess.CompletedProcess[str]) -> dict[str, tuple[int, bool]]:
    assert result.returncode == 0, result.stderr
    parts = json.loads(result.stdout)["parts"]
    return {p["part"]: (p["lag_events"], p["lag_estimated"]) for p in parts}


def test_run_raises_its_open_files_limit_to_the_hard_one(tmp_path: Path) -> None:
    # Limits as container runtimes commonly set them: a low soft limit, a higher hard one.
    limited = ["sh", "-c", 'ulimit -Sn 256 && ulimit -Hn 4096 && exec "$@"', "sh"]
    env = {**os.environ, "RELAY_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/x",
           "RELAY_BOOTSTRAP_SERVERS": "127.0.0.1:1", "RELAY_METRICS_ENABLED": "false"}  # fmt: skip
    with (tmp_path / "relay.log").open("wb") as log:
        relay = subprocess.Popen([*limited, *EXE, "run"], cwd=REPO, env=env, stderr=log)
    try:
        # Postgres is unreachable: the relay waits for it, with its limits raised.
        wait_until(lambda: "cannot start yet" in (tmp_path / "relay.log").read_text())
        limits = Path(f"/proc/{relay.pid}/limits").read_text()
        assert re.search(r"^Max open files\s+4096\s+4096\s", limits, re.M), limits
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=30) == 0
