"""Issue #48: an operator's hands never lose an event. `subscribers skip` skips exactly
the events named; every reset and skip stays on the record (the ledger), in `status`,
`subscribers list`, `verify` and `subscribers history`, across any number of resets;
the commands that skip or republish events preview them and ask first.

In production's shape: the relay and the CLI as the relay role, writers as the writer
role, the `halt` default, and deploy/README.md's recipe as written."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.store import OutboxStore
from relay.core.model import ConsumedRecord
from tests.support import REPO, consume, run_cli, wait_caught_up, wait_until

INSERT = (
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT %s, n::text, 'OrderPlaced', '{}' FROM generate_series(1, %s) AS n"
)


def _json(result: subprocess.CompletedProcess[str], code: int = 0) -> Any:
    assert result.returncode == code, result.stderr
    return json.loads(result.stdout)


def _part(db: psycopg.Connection[Any], name: str = "s") -> tuple[str, int, Any, str | None]:
    row = db.execute(
        "SELECT transaction_id::text, position, generation, halted_error"
        " FROM outbox_checkpoints WHERE subscriber = %s",
        (name,),
    ).fetchone()
    assert row is not None
    return row


def _ids(records: list[ConsumedRecord]) -> list[str | None]:
    return sorted(r.message_id for r in records)


def publish_all(db: psycopg.Connection[Any], start_relay: Any, name: str) -> None:
    """A relay publishes every event of ``name`` so far, then stops."""
    relay = start_relay()
    wait_caught_up(db, name, timeout=300)  # a ceiling: the first relay waits for Kafka
    relay.stop()


def recipe(section: str, command: str) -> list[str]:
    """The line of deploy/README.md's sh block after ``section`` that runs ``command``,
    as written (its comment dropped)."""
    text = (REPO / "deploy" / "README.md").read_text()
    block = text[text.index(section) :].split("```sh\n", 1)[1].split("```", 1)[0]
    [line] = [ln for ln in block.splitlines() if ln.startswith(f"outbox-relay {command}")]
    return shlex.split(line, comments=True)[1:]


def test_skip_publishes_every_event_of_the_transaction_but_the_poison_one(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    """The issue's case: one transaction of 4 events, k3's aggregate type an illegal
    topic name. The part halts before the batch; deploy/README's recipe, as written,
    skips k3 alone: k1, k2 and k4 are published once each, k3 never, and verify
    reports k3 as skipped by the operator, with its ledger entry, and nothing else."""
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    topic = topic_prefix + "{aggregate_type}"
    added = run_cli("subscribers", "add", "s", "--topic", topic, "--format", "json", env=env)
    assert added.returncode == 0, added.stderr
    rows = writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES "
        "('order', 'k1', 'OrderPlaced', '{}'), ('order', 'k2', 'OrderPlaced', '{}'), "
        "('no topic!', 'k3', 'OrderPlaced', '{}'), ('order', 'k4', 'OrderPlaced', '{}') "
        "RETURNING message_id::text, aggregate_id"
    ).fetchall()
    ids = {key: mid for mid, key in rows}
    start_relay()
    wait_until(lambda: _part(db)[3] is not None, timeout=300, what="the halt")

    [part] = _json(run_cli("status", "--json", env=env))["parts"]
    command = f"`outbox-relay subscribers skip s --event {ids['k3']}`"
    assert ids["k3"] in part["halted"] and command in part["halted"]
    assert "would skip 3 event(s) of this part, 2 of them before this one" in part["halted"]

    args = recipe("To get a halted part going again:", "subscribers skip")
    args = [{"NAME": "s", "MESSAGE_ID": ids["k3"]}.get(a, a) for a in args]
    skipped = run_cli(*args, env=env)
    assert skipped.returncode == 0, skipped.stderr
    assert "part 0 resumed" in skipped.stdout
    wait_caught_up(db, "s", timeout=300)
    published = consume(kafka_bootstrap, [topic_prefix + "order"], 3)
    assert _ids(published) == sorted([ids["k1"], ids["k2"], ids["k4"]])

    verify = run_cli("verify", "--json", "--timeout", "30", env=env)
    [report] = _json(verify, code=4)
    assert (report["found"], report["missing"], report["duplicated"]) == (3, 0, 0)
    assert (report["skipped_by_operator"], report["skipped_by_skip"]) == (1, 1)
    assert (report["verdict"], report["clean"], report["problems"]) == (
        "skipped by operator",
        False,
        False,
    )
    [skip] = report["skips"]
    assert (skip["message_id"], skip["action"]) == (ids["k3"], "skip")
    table = run_cli("verify", "--timeout", "30", env={**env, "COLUMNS": "250"})
    assert table.returncode == 4 and "skipped by operator" in table.stdout
    assert f"event {ids['k3']} skipped by `skip` (ledger #{skip['ledger_id']}" in table.stderr


def test_every_reset_forward_stays_reported_as_skipped(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    """Two resets forward with events published in between: the first one's skip used
    to vanish from status, subscribers list and verify."""
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    topic = topic_prefix + "s"
    added = run_cli("subscribers", "add", "s", "--topic", topic, "--format", "json", env=env)
    assert added.returncode == 0, added.stderr
    writer_db.execute(INSERT, ("order", 4))
    assert run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env).returncode == 0
    writer_db.execute(INSERT, ("order", 3))
    publish_all(db, start_relay, "s")
    writer_db.execute(INSERT, ("order", 2))
    second = run_cli("subscribers", "reset", "s", "--to", "now", "--yes", env=env)
    assert second.returncode == 0, second.stderr
    assert "SKIPS 2 event(s)" in second.stdout

    [part] = _json(run_cli("status", "--json", env=env))["parts"]
    assert (part["skipped_by_operator"], part["skipped_by_reset"], part["lag_events"]) == (6, 6, 0)
    [listed] = _json(run_cli("subscribers", "list", "--json", env=env))
    assert listed["skipped_by_operator"] == 6
    assert [k["events"] for k in listed["skips"]] == [4, 2]
    table = run_cli("status", env={**env, "COLUMNS": "250"})
    assert "skipped by operator" in table.stdout and "ledger #" in table.stdout

    [report] = _json(run_cli("verify", "--json", "--timeout", "30", env=env), code=4)
    assert (report["skipped_by_reset"], report["missing"], report["found"]) == (6, 0, 0)
    assert not report["clean"] and not report["problems"]
    history = _json(run_cli("subscribers", "history", "s", "--json", env=env))
    assert [(e["action"], e["events"]) for e in history] == [
        ("add", None),
        ("reset", 4),
        ("reset", 2),
    ]


def test_a_reset_to_the_beginning_shows_what_it_republishes_and_asks_first(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    added = run_cli("subscribers", "add", "s", "--topic", topic_prefix + "s", env=env)
    assert added.returncode == 0, added.stderr
    writer_db.execute(INSERT, ("order", 37))
    publish_all(db, start_relay, "s")
    before = _part(db)

    dry = run_cli("subscribers", "reset", "s", "--to", "beginning", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "37 published AGAIN" in dry.stdout and "nothing changed" in dry.stdout
    assert _part(db) == before

    refused = run_cli("subscribers", "reset", "s", "--to", "beginning", env=env)
    assert refused.returncode == 2, refused.stderr
    assert "37 published AGAIN" in refused.stdout and "--yes" in refused.stderr
    assert _part(db) == before

    asked = _on_a_terminal(["subscribers", "reset", "s", "--to", "beginning"], "n\n", env)
    assert asked.returncode == 1 and "Go ahead?" in asked.stdout
    assert _part(db) == before

    done = run_cli("subscribers", "reset", "s", "--to", "beginning", "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert _part(db)[:2] == ("0", 0)
    *_, reset = _json(run_cli("subscribers", "history", "s", "--json", env=env))
    assert (reset["action"], reset["events"], reset["params"]["to"]) == ("reset", 37, "beginning")
    assert reset["params"]["parts"] == [
        {"part": 0, "from": f"{before[0]}:{before[1]}", "to": "0:0", "republished": 37}
    ]


def _on_a_terminal(args: list[str], answer: str, env: dict[str, str]) -> Any:
    """The CLI with a terminal as its stdin, answering ``answer`` to its question."""
    import pty

    leader, follower = pty.openpty()
    try:
        os.write(leader, answer.encode())
        return subprocess.run(
            [sys.executable, "-m", "relay", *args],
            stdin=follower,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            cwd=REPO,
            timeout=120,
            check=False,
        )
    finally:
        os.close(follower)
        os.close(leader)


def test_a_skip_of_a_published_unknown_or_other_subscribers_event_is_refused(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    for name, aggregate in (("orders", "order"), ("customers", "customer")):
        added = run_cli(
            "subscribers", "add", name, "--topic", topic_prefix + name, "--format", "json",
            "--aggregate-type", aggregate, env=env,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
    [[published]] = writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', '1', 'OrderPlaced', '{}') RETURNING message_id::text"
    ).fetchall()
    publish_all(db, start_relay, "orders")
    [[customer]] = writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('customer', '1', 'CustomerJoined', '{}') RETURNING message_id::text"
    ).fetchall()
    before = [_part(db, "orders"), _part(db, "customers")]
    for event, why in (
        (published, "is published already: part 0's checkpoint is"),
        (str(uuid.uuid4()), "is not in the outbox"),
        (customer, "is not one subscriber 'orders' publishes: its filters leave it out"),
    ):
        refused = run_cli("subscribers", "skip", "orders", "--event", event, "--yes", env=env)
        assert refused.returncode == 1, refused.stderr
        assert "nothing skipped" in refused.stderr and why in refused.stderr
        assert event in refused.stderr and "Traceback" not in refused.stderr
    assert [_part(db, "orders"), _part(db, "customers")] == before
    history = _json(run_cli("subscribers", "history", "orders", "--json", env=env))
    assert [e["action"] for e in history] == ["add"]


def test_the_ledger_lists_each_intervention_with_who_and_counts_and_is_append_only(
    db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    assert run_cli("subscribers", "add", "s", "--topic", "s", env=env).returncode == 0
    [[event]] = writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', '1', 'OrderPlaced', '{}') RETURNING message_id::text"
    ).fetchall()
    writer_db.execute(INSERT, ("order", 5))
    for args in (
        ("pause", "s"),
        ("resume", "s"),
        ("skip", "s", "--event", event, "--yes"),
        ("reset", "s", "--to", "now", "--yes"),
        ("remove", "s"),
    ):
        done = run_cli("subscribers", *args, env=env)
        assert done.returncode == 0, done.stderr
    history = _json(run_cli("subscribers", "history", "s", "--json", env=env))
    assert [(e["action"], e["events"]) for e in history] == [
        ("add", None), ("pause", None), ("resume", None), ("skip", 1), ("reset", 5),
        ("remove", None),
    ]  # fmt: skip
    role = relay_db.execute("SELECT current_user::text").fetchone()
    assert {(e["db_role"], e["os_user"], e["host"]) for e in history} == {
        (role[0] if role else None, getpass.getuser(), socket.gethostname())
    }
    assert history[3]["params"]["events"][0]["message_id"] == event
    assert history[-1]["params"]["definition"]["topic"] == "s"
    table = run_cli("subscribers", "history", "s", env={**env, "COLUMNS": "250"})
    assert table.returncode == 0 and "remove" in table.stdout and "reset" in table.stdout

    for statement in (
        "UPDATE outbox_interventions SET events = 0",
        "DELETE FROM outbox_interventions",
        "DELETE FROM outbox_skipped",
        "TRUNCATE outbox_interventions",
        "INSERT INTO outbox_interventions (subscriber, action, db_role) VALUES ('s', 'skip', 'x')",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            relay_db.execute(statement)
    assert len(OutboxStore(db).ledger("s")) == len(history)


def test_an_intervention_that_cannot_be_recorded_is_not_made(database_url: str) -> None:
    """On a schema without the ledger (before migration 0019), as its owner: a relay of
    the previous version's schema, before `migrate` and `grant` (tests/README.md)."""
    from relay.adapters.postgres import migrations
    from relay.core.subscribers import Subscriber, ValueFormat

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=18)
        OutboxStore(conn).add(Subscriber("s", topic="s", value_format=ValueFormat.JSON))
        paused = run_cli("subscribers", "pause", "s", env={"RELAY_DATABASE_URL": database_url})
        assert paused.returncode == 1, paused.stderr
        assert "migration 0019" in paused.stderr and "nothing was changed" in paused.stderr
        assert not OutboxStore(conn).get("s").subscriber.paused
