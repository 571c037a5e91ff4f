"""Routing control on real Postgres and Kafka (issue #33): a subscriber keyed by a
payload field, partitioned by another, with a header and an envelope field; rows that
lack what their routing needs, or name a partition beyond the subscriber's partition
count, are dead-lettered with the reason while the rest goes on; a partition count the
subscriber's topics cannot hold is refused at `subscribers add` and at start-up. The relay runs as the relay
role, the rows come from the writer role, the subscriber from `subscribers add`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.daemon import Relay
from relay.errors import ConfigError
from tests.support import consume, run_cli, wait_caught_up, wait_for_topics, wait_until

ROWS = [
    # (aggregate_id, tenant, shard)
    ("o-1", "acme", 0),
    ("o-2", "acme", 2),
    ("o-3", "globex", 1),
    ("o-1", "acme", 0),
    ("o-4", None, 1),  # no tenant: its key cannot be made
    ("o-5", "globex", 7),  # beyond its partition count, 3
    ("o-6", "globex", 2),
]


def test_key_partition_and_placements_come_from_the_row(
    db: psycopg.Connection[Any],
    database_url: str,
    writer_db: psycopg.Connection[Any],
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    topic = topic_prefix + "orders"
    added = run_cli(
        "subscribers", "add", "routed", "--topic", topic, "--format", "json",
        "--key", "{payload.tenant}", "--partition-by", "payload.shard", "--partition-count", "3",
        "--placement", "payload.tenant:header:tenant",
        "--placement", "event_type:envelope:kind",
        "--on-poison", "dead-letter", "--dead-letter-topic", topic_prefix + "dead",
        env={"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    listed = json.loads(
        run_cli("subscribers", "list", "--json", env={"RELAY_DATABASE_URL": database_url}).stdout
    )
    assert listed[0]["key"] == "{payload.tenant}"
    assert listed[0]["placements"] == [
        "payload.tenant:header:tenant",
        "event_type:envelope:kind",
    ]

    outbox = Outbox(None)
    with writer_db.transaction():
        for n, (aggregate, tenant, shard) in enumerate(ROWS):
            payload: dict[str, Any] = {"shard": shard, "n": n}
            if tenant is not None:
                payload["tenant"] = tenant
            outbox.append(
                writer_db,
                aggregate_type="order",
                aggregate_id=aggregate,
                event_type="OrderPlaced",
                payload=payload,
            )
    start_relay(topic_partitions=3)
    seen = consume(kafka_bootstrap, [topic], 5, quiet=2.0)
    wait_caught_up(db, "routed")

    published = sorted(seen, key=lambda r: json.loads(r.value or b"")["payload"]["n"])
    assert [(r.key, r.partition) for r in published] == [
        (b"acme", 0),
        (b"acme", 2),
        (b"globex", 1),
        (b"acme", 0),
        (b"globex", 2),
    ]
    first = published[0]
    assert first.header("tenant") == b"acme"
    assert json.loads(first.value or b"") == {
        "payload": {"shard": 0, "n": 0, "tenant": "acme"},
        "kind": "OrderPlaced",
    }
    # Per key and partition, database order.
    acme = [json.loads(r.value or b"")["payload"]["n"] for r in seen if r.partition == 0]
    assert acme == [0, 3]

    def dead_lettered() -> list[tuple[str, str]]:
        return db.execute(
            "SELECT o.aggregate_id, d.error FROM outbox_dead_letters d "
            "JOIN outbox o USING (transaction_id, position) ORDER BY o.aggregate_id"
        ).fetchall()

    wait_until(lambda: len(dead_lettered()) == 2, what="two dead letters")
    (no_tenant, too_far) = dead_lettered()
    assert no_tenant[0] == "o-4" and "its key needs payload.tenant" in no_tenant[1]
    assert too_far[0] == "o-5" and "is 7, out of range" in too_far[1]
    assert len(consume(kafka_bootstrap, [topic_prefix + "dead"], 2, quiet=1.0)) == 2
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    checked = run_cli("verify", "--subscriber", "routed", "--json", "--timeout", "60", env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (report,) = json.loads(checked.stdout)
    assert (report["missing"], report["duplicated"], report["out_of_order"]) == (0, 0, 0)
    assert (report["found"], report["dead_lettered"]) == (5, 2)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--key", "{tenant}"], "not a field"),
        (["--placement", "payload.a:envelope", "--format", "avro"], "envelope placement"),
        (["--partition-by", "payload"], "not a field"),
    ],
)
def test_subscribers_add_refuses_routing_it_cannot_apply(
    db: psycopg.Connection[Any], database_url: str, option: list[str], message: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_SCHEMAS_DIR": "schemas"}
    result = run_cli("subscribers", "add", "bad", *option, env=env)
    assert result.returncode != 0
    assert message in result.stderr
    assert db.execute("SELECT count(*) FROM outbox_subscribers").fetchone() == (0,)


def test_subscribers_add_refuses_a_partition_count_its_topics_cannot_hold(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, topic_prefix: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    two = topic_prefix + "two"
    made = run_cli("topics", "create", two, "--partitions", "2", env=env)
    assert made.returncode == 0, made.stderr
    wait_for_topics(kafka_bootstrap, [two])

    def add(*options: str, environment: dict[str, str] = env) -> Any:
        return run_cli(
            "subscribers", "add", "shards", "--format", "json", "--partition-by", "payload.shard",
            *options, env=environment,
        )  # fmt: skip

    # The topic exists with 2 partitions: the broker's count holds.
    refused = add("--topic", two, "--partition-count", "3")
    assert refused.returncode != 0
    assert f"partition_count (--partition-count) is 3, but its topic {two!r} has 2" in (
        refused.stderr
    )
    # A topic the relay is to create gets topic_partitions (3 unless configured).
    refused = add("--topic", topic_prefix + "new", "--partition-count", "4")
    assert refused.returncode != 0
    assert "creates the subscriber's topics with topic_partitions (3)" in refused.stderr
    # Without a count, or without a broker to ask, nothing can be checked.
    refused = add("--topic", two)
    assert refused.returncode != 0 and "needs partition_count (--partition-count)" in (
        refused.stderr
    )
    refused = add(
        "--topic", two, "--partition-count", "2", environment={"RELAY_DATABASE_URL": database_url}
    )
    assert refused.returncode != 0 and "--partition-by" in refused.stderr
    assert "bootstrap_servers" in refused.stderr
    assert db.execute("SELECT count(*) FROM outbox_subscribers").fetchone() == (0,)

    accepted = add("--topic", two, "--partition-count", "2")
    assert accepted.returncode == 0, accepted.stderr
    more = add("--topic", topic_prefix + "new", "--partition-count", "4", "--replace")
    assert more.returncode != 0  # nor by --replace
    env_wide = {**env, "RELAY_TOPIC_PARTITIONS": "4"}
    more = add("--topic", topic_prefix + "new", "--partition-count", "4", "--replace",
               environment=env_wide)  # fmt: skip
    assert more.returncode == 0, more.stderr


def test_the_relay_refuses_to_start_with_a_partition_count_its_topics_cannot_hold(
    kafka_bootstrap: str, topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    two = topic_prefix + "two"
    env = {"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    assert run_cli("topics", "create", two, "--partitions", "2", env=env).returncode == 0
    wait_for_topics(kafka_bootstrap, [two])
    definition = {"name": "shards", "topic": two, "value_format": "json"}
    routing = {"partition_by": "payload.shard", "partition_count": 3}
    with pytest.raises(ConfigError) as refused:
        start_relay(subscribers=[{**definition, **routing}])
    assert f"its topic {two!r} has 2 partitions" in str(refused.value)
    assert "subscriber 'shards' is not created" in str(refused.value)
