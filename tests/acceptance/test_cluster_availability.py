"""One broker lost is not an outage (issue #29): on three Kafka nodes (replication
factor 3, min.insync.replicas 2, the transaction state log likewise), two relays keep
their sessions and keep publishing while the node coordinating most of their
transactional ids, and leading some of their partitions, is killed with ``kill -9`` and
restarted, with writers racing throughout. Afterwards every event is on Kafka exactly
once and in per-key order.

Asserted: no relay gave up its session, some part always had an owner, each part's
longest publishing gap was at most 15 s (the issue's target), and while the node was
down the broker watch judged Kafka reachable and named exactly the partition left
without a leader (a single-replica topic on that node). The figures print with ``-s``.
The relays run as the relay role, the writers as the writer role. ``ride_out`` and
``FAULTS`` (cluster_faults.py) also serve bench/cluster.py, which measures one fault at a
time (leader, coordinator, rolling restart).
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from relay import Outbox
from relay.adapters.kafka.broker_watch import BrokerWatch
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalKafkaCluster
from tests.acceptance.cluster_faults import admin, delivery_problems, ride_out
from tests.support import Roles, sub, wait_until

pytestmark = pytest.mark.cluster

# The longest a part may publish nothing when one node dies: the target (#29).
# Most of a gap is the brokers' own failover (new leaders, the transaction coordinator
# loading its state): on a 2-core host at load 35-40 gaps were 5-12 s, at load 55-75 the
# brokers alone took 15-30 s, and this fails there.
MAX_GAP_S = 15.0


@pytest.mark.timeout(600)
def test_two_relays_ride_out_the_leader_and_the_coordinator_killed(
    db: psycopg.Connection[Any],
    roles: Roles,
    outbox: Outbox,
    registry: SchemaFolder,
    kafka_cluster: LocalKafkaCluster,
    topic_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One single-replica topic on each node: the killed node's has no leader while it is
    # down, and the broker watch must say so (and only that) while Kafka still answers.
    single = {n.node_id: f"{topic_prefix}on-node-{n.node_id}" for n in kafka_cluster.nodes}
    client = admin(kafka_cluster)
    for node, name in single.items():
        client.create_topics([NewTopic(name, 1, -1, replica_assignment=[[node]])])[name].result(30)
    outbox_topic = topic_prefix + "outbox.event.order"
    verdicts: list[tuple[bool | None, tuple[str, ...]]] = []

    def watch_while_down(node: int) -> None:
        watch = BrokerWatch(
            {"bootstrap.servers": kafka_cluster.bootstrap_servers},
            interval=0.5,
            timeout=5.0,
            written_topics=lambda: {*single.values(), outbox_topic},
        )
        watch.start()
        try:
            wait_until(
                lambda: watch.leaderless == (f"{single[node]}[0]",),
                timeout=60.0,  # the controller fences the node first (seen: 10 s at load 70)
                what=f"the watch to see {single[node]} without a leader, and only it",
            )
        finally:
            watch.stop()
            verdicts.append((watch.reachable, watch.leaderless))

    ridden = ride_out(
        ["both"], roles, outbox, registry, kafka_cluster, topic_prefix, watch_while_down
    )
    seen, log = ridden.seen, ridden.log
    # Transactional calls the watchdog gave up on (relay/adapters/kafka/kafka.py, _watched). A figure.
    hung = sum("did not return within" in r.getMessage() for r in caplog.records)
    print(json.dumps({"faults": log, **seen.as_dict(), "hung_calls": hung}, indent=2))
    assert verdicts and all(reachable for reachable, _ in verdicts), verdicts
    # No relay gave up its session: each held one and the same one throughout.
    for i, sessions in seen.sessions.items():
        assert len(sessions) == 1 and None not in sessions, f"relay {i}: sessions {sessions}"
    assert seen.ownerless_samples == 0, seen.as_dict()
    # The availability target (#29), not a speed figure: each part published again
    # within 15 s of the node's death.
    assert max(seen.longest_gap.values()) <= MAX_GAP_S, seen.as_dict()
    assert delivery_problems(db, kafka_cluster.bootstrap_servers, outbox_topic) == []


def test_start_up_warns_about_topics_one_broker_could_take_down(
    db: psycopg.Connection[Any],
    database_url: str,
    registry: SchemaFolder,
    kafka_cluster: LocalKafkaCluster,
    topic_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    checkpoints = topic_prefix + "checkpoints"
    client = admin(kafka_cluster)  # referenced until the topic exists
    client.create_topics([NewTopic(checkpoints, 2, 1)])[checkpoints].result(30)
    relay = Relay(
        load_settings(
            database_url=database_url,
            bootstrap_servers=kafka_cluster.bootstrap_servers,
            subscribers=[sub("s", topic_prefix, value_format="json")],
            checkpoint_topic=checkpoints,
            topic_replication_factor=1,
            metrics_port=0,
        ),
        registry=registry,
    )
    relay.start()
    try:
        wait_until(
            lambda: any(r.name == "relay.adapters.kafka.replication_check" for r in caplog.records),
            what="the replication advice",
        )
    finally:
        relay.stop()
    advice = [
        r.getMessage() for r in caplog.records if r.name == "relay.adapters.kafka.replication_check"
    ]
    assert any(checkpoints in a and "one replica" in a for a in advice), advice
    assert any("topic_replication_factor is 1" in a for a in advice), advice
