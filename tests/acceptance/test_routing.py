"""Routing control on real Postgres and Kafka (issue #33): a subscriber keyed by a
payload field, partitioned by another, with a header and an envelope field; rows that
lack what their routing needs, or name a partition the topic does not have, are
dead-lettered with the reason while the rest goes on. The relay runs as the relay
role, the rows come from the writer role, the subscriber from `subscribers add`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.daemon import Relay
from tests.support import consume, run_cli, wait_caught_up, wait_until

ROWS = [
    # (aggregate_id, tenant, shard)
    ("o-1", "acme", 0),
    ("o-2", "acme", 2),
    ("o-3", "globex", 1),
    ("o-1", "acme", 0),
    ("o-4", None, 1),  # no tenant: its key cannot be made
    ("o-5", "globex", 7),  # the topic has 3 partitions
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
        "--key", "{payload.tenant}", "--partition-by", "payload.shard",
        "--placement", "payload.tenant:header:tenant",
        "--placement", "event_type:envelope:kind",
        "--on-poison", "dead-letter", "--dead-letter-topic", topic_prefix + "dead",
        env={"RELAY_DATABASE_URL": database_url},
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
    assert too_far[0] == "o-5" and "partition 7 does not exist" in too_far[1]
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
