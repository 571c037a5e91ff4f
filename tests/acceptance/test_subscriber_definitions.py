"""Issue #48, items 2 and 7: a subscriber's definition changes only as the operator says.

- `subscribers add --replace` that would reset options not given shows the difference
  and refuses without --yes; `subscribers set` changes only the options given, and a
  filter it narrows waits for --yes, naming the events waiting that it drops.
- A refused start leaves nothing behind: `run` checks every subscriber its config
  declares before it writes any (a new one is not created, a changed one stays as
  stored), so neither the next start nor a relay already running meets it.
- `subscribers resume --all` resumes every paused or halted subscriber.

As production runs them: the relay role, the writer role, a real Postgres and Kafka.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres.store import OutboxStore
from relay.daemon import Relay
from tests.support import REPO, consume, run_cli, sub, wait_caught_up, wait_for_topics, wait_until

StartRelay = Callable[..., Relay]


def _listed(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    listed = run_cli("subscribers", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    return {s["name"]: s for s in json.loads(listed.stdout)}


def _write(writer_db: psycopg.Connection[Any], *events: tuple[str, str]) -> None:
    """Events of (aggregate_type, aggregate_id), as an application inserts them."""
    for aggregate_type, aggregate_id in events:
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES (%s, %s, 'Happened', '{}')",
            (aggregate_type, aggregate_id),
        )


# -- add --replace and set ------------------------------------------------------------


def test_add_replace_shows_the_options_it_would_reset_and_refuses_without_yes(
    relay_db: psycopg.Connection[Any], relay_url: str, topic_prefix: str
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    topic = topic_prefix + "billing.{aggregate_type}"
    added = run_cli("subscribers", "add", "billing", "--aggregate-type", "order",
                    "--topic", topic, "--from", "now", env=env)  # fmt: skip
    assert added.returncode == 0, added.stderr
    before = _listed(env)["billing"]

    replace = ["subscribers", "add", "billing", "--replace", "--on-poison", "dead-letter"]
    refused = run_cli(*replace, env=env)

    assert refused.returncode == 2, refused.stderr
    assert "aggregate_types: order → (all)" in refused.stdout
    assert f"topic: {topic} → outbox.event.{{aggregate_type}}" in refused.stdout
    assert "on_poison: halt → dead-letter" in refused.stdout
    message = " ".join(refused.stderr.split())
    # The fields given are not among those it resets.
    assert "not given back to their defaults (topic, aggregate_types)" in message
    assert _listed(env)["billing"] == before

    applied = run_cli(*replace, "--yes", env=env)
    assert applied.returncode == 0, applied.stderr
    assert "updated subscriber 'billing'" in applied.stdout
    after = _listed(env)["billing"]
    assert (after["aggregate_types"], after["on_poison"]) == (None, "dead-letter")
    assert after["checkpoint"] == before["checkpoint"]  # a definition, not a checkpoint


def test_set_changes_only_the_options_given_and_the_filter_still_holds_in_kafka(
    relay_db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    topic = topic_prefix + "shop"
    added = run_cli("subscribers", "add", "shop", "--aggregate-type", "order", "--topic", topic,
                    env=env)  # fmt: skip
    assert added.returncode == 0, added.stderr

    changed = run_cli("subscribers", "set", "shop", "--on-poison", "dead-letter", env=env)

    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.splitlines()[0].strip() == "on_poison: halt → dead-letter"
    assert "updated subscriber 'shop'" in changed.stdout
    listed = _listed(env)["shop"]
    assert (listed["aggregate_types"], listed["topic"], listed["on_poison"]) == (
        ["order"], topic, "dead-letter",
    )  # fmt: skip
    # On the ledger, with the change field by field.
    entries = _history(env, "shop")
    assert [e["action"] for e in entries] == ["add", "set"]
    assert entries[1]["params"]["changed"] == ["on_poison: halt → dead-letter"]
    _write(writer_db, ("order", "o1"), ("customer", "c1"), ("order", "o2"))
    start_relay()
    wait_caught_up(relay_db, "shop")
    seen = consume(kafka_bootstrap, [topic], expected=2)
    assert sorted((r.key or b"").decode() for r in seen) == ["o1", "o2"]  # no customer


def test_set_narrowing_the_filter_names_the_events_it_drops_and_waits_for_yes(
    relay_db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    topic_prefix: str,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    added = run_cli("subscribers", "add", "all", "--topic", topic_prefix + "all", env=env)
    assert added.returncode == 0, added.stderr
    _write(writer_db, ("order", "o1"), ("customer", "c1"), ("customer", "c2"))
    narrow = ["subscribers", "set", "all", "--aggregate-type", "order"]

    for refused in (run_cli(*narrow, env=env), run_cli(*narrow, "--dry-run", env=env)):
        assert "aggregate_types: (all) → order" in refused.stdout
        assert "the filter narrows (aggregate_types): 2 events waiting" in refused.stderr
        assert _listed(env)["all"]["aggregate_types"] is None
    assert run_cli(*narrow, env=env).returncode == 2

    applied = run_cli(*narrow, "--yes", env=env)
    assert applied.returncode == 0, applied.stderr
    assert _listed(env)["all"]["aggregate_types"] == ["order"]
    widened = run_cli("subscribers", "set", "all", "--unset", "aggregate-type", env=env)
    assert widened.returncode == 0, widened.stderr  # nothing dropped: no --yes needed
    assert "the filter widens (aggregate_types)" in widened.stderr
    assert _listed(env)["all"]["aggregate_types"] is None


# -- a refused start leaves nothing behind ----------------------------------------------


def _run_refused(tmp_path: Path, env: dict[str, str], *subscribers: dict[str, Any]) -> str:
    """`outbox-relay run` with ``subscribers`` in its config file: it must refuse (exit 2),
    else it would run on; returns its stderr."""
    config = tmp_path / "relay.toml"
    config.write_text(
        "[relay]\n" + "".join(f"[[relay.subscribers]]\n{_toml(s)}" for s in subscribers)
    )
    run_env = {**env, "RELAY_CONFIG": str(config), "RELAY_METRICS_PORT": "0"}
    done = run_cli("run", env=run_env, timeout=180)
    assert done.returncode == 2, done.stderr
    return " ".join(done.stderr.split())


def _history(env: dict[str, str], name: str) -> list[dict[str, Any]]:
    done = run_cli("subscribers", "history", name, "--json", env=env)
    assert done.returncode == 0, done.stderr
    entries: list[dict[str, Any]] = json.loads(done.stdout)
    return entries


def _toml(table: dict[str, Any]) -> str:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())


def _stored(db: psycopg.Connection[Any]) -> dict[str, Any]:
    return {s.subscriber.name: s.subscriber for s in OutboxStore(db).list()}


def test_a_start_refused_for_partitions_writes_nothing_and_a_running_relay_never_meets_it(
    relay_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    tmp_path: Path,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    two = topic_prefix + "two"
    assert run_cli("topics", "create", two, "--partitions", "2", env=env).returncode == 0
    wait_for_topics(kafka_bootstrap, [two])
    keep = sub("keep", topic_prefix)
    running = start_relay(subscribers=[keep])
    shards = {"name": "shards", "topic": two, "value_format": "json",
              "partition_by": "payload.shard", "partition_count": 3}  # fmt: skip

    refused = _run_refused(tmp_path, env, keep, shards)

    assert f"its topic {two!r} has 2 partitions" in refused
    assert "nothing was written: subscriber 'shards' is not created" in refused
    assert set(_stored(relay_db)) == {"keep"}
    # Removed from the config, it is gone for good: the next start is not refused.
    started = start_relay(subscribers=[keep])
    for relay in (running, started):
        assert [p for p in relay.workers if p.subscriber == "shards"] == []

    # A refused change of an existing subscriber leaves the stored one as it was.
    add = ["subscribers", "add", "shards", "--topic", two, "--format", "json",
           "--partition-by", "payload.shard", "--partition-count", "2"]  # fmt: skip
    assert run_cli(*add, env=env).returncode == 0
    refused = _run_refused(tmp_path, env, keep, shards)
    assert "nothing was written: subscriber 'shards' stays as stored" in refused
    assert "outbox-relay subscribers pause shards" in refused
    assert _stored(relay_db)["shards"].partition_count == 2


def test_a_start_refused_for_avro_without_schemas_writes_nothing(
    relay_db: psycopg.Connection[Any], relay_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    added = run_cli("subscribers", "add", "plain", "--topic", "plain", env=env)
    assert added.returncode == 0, added.stderr

    refused = _run_refused(tmp_path, env, {"name": "typed", "topic": "t", "value_format": "avro"})

    assert "subscriber 'typed' publishes avro" in refused and "schemas_dir" in refused
    assert "subscriber 'typed' is not created" in refused
    assert set(_stored(relay_db)) == {"plain"}
    # The stored subscriber, changed by the config to avro: refused, kept as it was.
    refused = _run_refused(
        tmp_path, env, {"name": "plain", "topic": "plain", "value_format": "avro"}
    )
    assert "subscriber 'plain' stays as stored" in refused
    assert _stored(relay_db)["plain"].value_format == "json"


@pytest.mark.registry
@pytest.mark.timeout(1800)
def test_a_start_refused_by_the_registry_writes_nothing(
    relay_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schema_registry: str,
    tmp_path: Path,
) -> None:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    topic = f"{topic_prefix}orders"
    order = json.loads((REPO / "schemas" / "demo" / "OrderPlaced.avsc").read_text())
    # An older OrderPlaced whose amount was text: the repo's (a long) cannot read it.
    text_amount = {**order, "fields": [
        {**f, "type": "string"} if f["name"] == "amount_cents" else f for f in order["fields"]
    ]}  # fmt: skip
    client = SchemaRegistryClient({"url": schema_registry})
    client.register_schema(f"{topic}-value", Schema(json.dumps(text_amount), "AVRO"))
    client.set_compatibility(f"{topic}-value", "BACKWARD")
    env = {
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_SCHEMAS_DIR": str(REPO / "schemas"),
        "RELAY_SCHEMA_REGISTRY_URL": schema_registry,
    }

    refused = _run_refused(tmp_path, env, {"name": "reg", "topic": topic,
                                           "value_format": "avro-registry"})  # fmt: skip

    assert f"subject '{topic}-value' (compatibility BACKWARD, versions [1])" in refused
    assert "subscriber 'reg' is not created" in refused
    assert _stored(relay_db) == {}


# -- resume --all ---------------------------------------------------------------------


def test_resume_all_resumes_every_paused_or_halted_subscriber(
    relay_db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    halting = sub("halting", topic_prefix, value_format="json")
    calm = {"name": "calm", "topic": topic_prefix + "calm", "value_format": "json"}
    relay = start_relay(subscribers=[halting, calm])
    _write(writer_db, ("bad topic", "1"))  # routed to a topic name Kafka refuses: poison
    store = OutboxStore(relay_db)
    wait_until(lambda: store.get("halting").parts[0].halted_error is not None, what="a halt")
    relay.stop()
    assert run_cli("subscribers", "pause", "calm", env=env).returncode == 0
    added = run_cli("subscribers", "add", "idle", "--topic", topic_prefix + "idle", env=env)
    assert added.returncode == 0, added.stderr

    resumed = run_cli("subscribers", "resume", "--all", env=env)

    assert resumed.returncode == 0, resumed.stderr
    assert "subscriber 'calm' resumed (was paused)" in resumed.stdout
    assert "subscriber 'halting' resumed (part 0 was halted: " in resumed.stdout
    assert "'idle'" not in resumed.stdout  # neither paused nor halted: untouched
    states = {s.subscriber.name: s for s in store.list()}
    assert not any(s.subscriber.paused for s in states.values())
    assert [p.halted_error for s in states.values() for p in s.parts] == [None, None, None]
    assert [e["action"] for e in _history(env, "halting")] == ["add", "resume"]
    assert [e["action"] for e in _history(env, "calm")] == ["add", "pause", "resume"]
    again = run_cli("subscribers", "resume", "--all", env=env)
    assert again.returncode == 0 and "no subscriber is paused or halted" in again.stdout
    neither = run_cli("subscribers", "resume", env=env)
    assert neither.returncode == 2 and "--all" in neither.stderr
