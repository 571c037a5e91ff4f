"""Issue #48: `outbox-relay subscribers replay` republishes a range of the outbox exactly
once, into a new topic, each record marked with the replay's ledger entry; it previews
and asks first, is on the ledger, verify checks it, and a replay killed mid-way (kill -9
of the CLI) and run again publishes nothing twice and misses nothing.

In production's shape: the relay and the CLI as the relay role, writers as the writer
role, deploy/README.md's recipe as written."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Any

import psycopg

from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.core.model import ConsumedRecord
from relay.core.replay import HEADER_REPLAY
from tests.support import REPO, consume, run_cli, wait_caught_up, wait_until


def _json(result: subprocess.CompletedProcess[str], code: int = 0) -> Any:
    assert result.returncode == code, result.stdout + result.stderr
    return json.loads(result.stdout)


def write(
    writer_db: psycopg.Connection[Any], db: psycopg.Connection[Any], kinds: list[str]
) -> list[tuple[str, str, str]]:
    """One transaction of events of these aggregate types, as the writer role writes
    them: (message id, key, type), the keys read by the owner (the writer reads none)."""
    rows = writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT kind, 'k' || n, 'Happened', pg_catalog.jsonb_build_object('n', n) "
        "FROM unnest(%s::text[]) WITH ORDINALITY AS u (kind, n) RETURNING message_id",
        (kinds,),
    ).fetchall()
    keys = db.execute(
        "SELECT message_id::text, transaction_id::text || ':' || position, aggregate_type "
        "FROM outbox WHERE message_id = ANY(%s) ORDER BY transaction_id, position",
        ([mid for (mid,) in rows],),
    ).fetchall()
    return [(mid, key, kind) for mid, key, kind in keys]


def replays(env: dict[str, str]) -> list[tuple[str, Any, Any]]:
    """The replay entries of subscriber s's ledger: (replay, of, events)."""
    history = _json(run_cli("subscribers", "history", "s", "--json", env=env))
    return [
        (e["params"]["replay"], e["params"].get("of"), e["events"])
        for e in history
        if e["action"] == "replay"
    ]


def recipe(values: dict[str, str]) -> list[list[str]]:
    """deploy/README.md's replay recipe, as written, its placeholders given ``values``."""
    text = (REPO / "deploy" / "README.md").read_text()
    section = text[text.index("To publish a range of events again") :]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(ln, comments=True)[1:] for ln in block.splitlines()]
    return [[values.get(a, a) for a in line] for line in lines if line]


def marked(records: list[ConsumedRecord], entry: int) -> list[str]:
    assert all(r.header(HEADER_REPLAY) == str(entry).encode() for r in records), records
    return sorted(r.message_id or "" for r in records)


def test_a_range_is_replayed_into_a_new_topic_once_each_previewed_recorded_and_verified(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    added = run_cli(
        *("subscribers", "add", "s", "--topic", topic_prefix + "{aggregate_type}"),
        *("--format", "json", "--aggregate-type", "order"),
        env=env,
    )
    assert added.returncode == 0, added.stderr
    events = [
        *write(writer_db, db, ["order", "customer", "order"]),
        *write(writer_db, db, ["order", "order"]),
        *write(writer_db, db, ["customer", "order"]),
    ]
    relay = start_relay()
    wait_caught_up(db, "s", timeout=300)
    relay.stop()
    first, last = events[2][1], events[5][1]  # the range: events 2 to 5, both included
    wanted = sorted(mid for mid, _, kind in events[2:6] if kind == "order")
    assert len(wanted) == 3
    into = topic_prefix + "replayed"
    dry_run, args, history, verify_it = recipe(
        {"NAME": "s", "FROM": first, "TO": last, "TOPIC": into}
    )

    dry = run_cli(*dry_run, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "publishes 3 event(s) AGAIN" in dry.stdout and "dry run: nothing changed" in dry.stdout
    assert f"[{first}, {last}]" in dry.stdout and into in dry.stdout
    without_yes = [a for a in args if a not in ("--yes", "-y")]
    refused = run_cli(*without_yes, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "needs --yes" in refused.stderr
    assert replays(env) == []  # neither changed anything

    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    [start, end] = replays(env)
    assert start[0] == "start" and start[2] == 3 and end[0] == "done"
    entry = end[1]
    assert f"replay #{entry} done: 3 event(s) published" in done.stdout
    assert marked(consume(kafka_bootstrap, [into], 3, quiet=2.0), entry) == wanted

    table = run_cli(*history, env={**env, "COLUMNS": "250"})
    assert table.returncode == 0 and "replay" in table.stdout
    checked = run_cli(*verify_it, "--timeout", "30", env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (
        f"replay #{entry} (" in checked.stderr
        and "found 3, missing 0, duplicated 0" in checked.stderr
    )
    verify = run_cli("verify", "--json", "--timeout", "30", env=env)
    [report] = _json(verify)
    assert report["clean"], report
    [check] = report["replays"]
    assert (check["entry"], check["done"], check["expected"], check["found"]) == (entry, True, 3, 3)
    assert (check["missing"], check["duplicated"]) == (0, 0)


def test_a_replay_killed_mid_way_and_run_again_publishes_each_event_once(
    db: psycopg.Connection[Any],
    relay_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    added = run_cli(
        *("subscribers", "add", "s", "--topic", topic_prefix + "s", "--format", "json"), env=env
    )
    assert added.returncode == 0, added.stderr
    events = write(writer_db, db, ["order"] * 300)
    into = topic_prefix + "replayed"
    args = ["subscribers", "replay", "s", "--from", events[0][1], "--to", events[-1][1]]
    args += ["--into", into, "--batch-size", "1", "--yes"]

    cli = subprocess.Popen(
        [sys.executable, "-m", "relay", *args],
        env={**os.environ, **env},
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    reader = KafkaTopicReader({"bootstrap.servers": kafka_bootstrap})
    try:
        wait_until(lambda: any(True for _ in reader.read([into])), timeout=300, what="a record")
        os.kill(cli.pid, signal.SIGSTOP)  # held still while the test looks, then killed
        committed = sum(1 for _ in reader.read([into]))
        os.kill(cli.pid, signal.SIGKILL)
    finally:
        cli.kill()
        cli.wait()
    assert 0 < committed < len(events), "the replay was not killed mid-way"
    assert [r[0] for r in replays(env)] == ["start"]  # open: no 'done'

    again = run_cli(*args, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "going on after" in again.stdout
    assert [r[0] for r in replays(env)] == ["start", "resume", "done"]
    entry = replays(env)[2][1]
    seen = consume(kafka_bootstrap, [into], len(events), quiet=2.0, timeout=120)
    assert marked(seen, entry) == sorted(mid for mid, _, _ in events)  # once each

    [report] = _json(run_cli("verify", "--json", "--timeout", "60", env=env))
    [check] = report["replays"]
    assert (check["found"], check["missing"], check["duplicated"]) == (len(events), 0, 0)
