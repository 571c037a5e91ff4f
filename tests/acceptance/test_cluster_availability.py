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
``ride_out`` and ``FAULTS`` also serve to measure one fault at a time (leader,
coordinator, rolling restart).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from relay import Outbox
from relay.broker_watch import BrokerWatch
from relay.daemon import Relay
from relay.localstack import LocalKafkaCluster
from relay.schemas import SchemaFolder
from relay.settings import load_settings
from relay.topic_reader import KafkaTopicReader
from relay.verify import verify
from tests.acceptance.cluster_faults import (
    TRANSACTION_STATE,
    Availability,
    AvailabilityProbe,
    admin,
    coordinators,
    kill_and_restart,
    leaders,
    replicas,
    rolling_restart,
    wait_fully_replicated,
)
from tests.support import (
    by_key,
    consume,
    order,
    session_id,
    sub,
    wait_caught_up,
    wait_until,
    write_orders,
)

pytestmark = pytest.mark.cluster

PARTS = 4
KEYS = [f"k{i}" for i in range(40)]
DOWN_FOR_S = 6.0  # a node stays dead this long before it restarts
SETTLE_S = 5.0  # publishing undisturbed before and after each fault
# The longest a part may publish nothing when one node dies: the target (#29).
# Most of a gap is the brokers' own failover (new leaders, the transaction coordinator
# loading its state): on a 2-core host at load 35-40 gaps were 5-12 s, at load 55-75 the
# brokers alone took 15-30 s, and this fails there.
MAX_GAP_S = 15.0


class Writers(threading.Thread):
    """App transactions of a few events each, about 200 events a second, until stopped."""

    def __init__(self, url: str, outbox: Outbox) -> None:
        super().__init__(name="writers", daemon=True)
        self._url = url
        self._outbox = outbox
        self._done = threading.Event()
        self.committed = 0

    def stop(self) -> None:
        self._done.set()
        self.join(30)

    def run(self) -> None:
        rng = random.Random(29)
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._done.wait(0.02):
                with conn.transaction():
                    for _ in range(4):
                        key = rng.choice(KEYS)
                        self._outbox.append(
                            conn,
                            aggregate_type="order",
                            aggregate_id=key,
                            event_type="OrderPlaced",
                            payload=order(f"{key}-{rng.randrange(10**9)}"),
                        )
                self.committed += 4


WhileDown = Callable[[int], object] | None


def kill_leader(
    cluster: LocalKafkaCluster, topics: list[str], log: list[str], while_down: WhileDown = None
) -> None:
    """``kill -9`` the node leading most partitions of ``topics``; restart it later."""
    leader = leaders(cluster, topics).most_common(1)[0][0]
    kill_and_restart(cluster, leader, DOWN_FOR_S, log, f"leads most of {topics[0]}", while_down)


def kill_coordinator(
    cluster: LocalKafkaCluster, ids: list[str], log: list[str], while_down: WhileDown = None
) -> None:
    """``kill -9`` the node coordinating most of ``ids``; restart it later."""
    coordinator = coordinators(cluster, ids).most_common(1)[0][0]
    kill_and_restart(cluster, coordinator, DOWN_FOR_S, log, "coordinates most parts", while_down)


def kill_leader_and_coordinator(
    cluster: LocalKafkaCluster,
    topics: list[str],
    ids: list[str],
    log: list[str],
    while_down: WhileDown = None,
) -> None:
    """``kill -9`` the node coordinating most of ``ids`` when it also leads partitions of
    ``topics`` (one kill, both faults: each node leads about a third of the partitions);
    otherwise the leader, then the coordinator."""
    led = leaders(cluster, topics)
    ranked = coordinators(cluster, ids).most_common()
    node = ranked[0][0]
    if led[node] == 0:
        kill_leader(cluster, topics, log, while_down)
        kill_coordinator(cluster, ids, log, while_down)
        return
    what = f"coordinates {ranked[0][1]} of {len(ids)} parts, leads {led[node]} partitions"
    kill_and_restart(cluster, node, DOWN_FOR_S, log, what, while_down)


Fault = Callable[[LocalKafkaCluster, list[str], list[str], list[str], WhileDown], None]
FAULTS: dict[str, Fault] = {
    "leader": lambda cluster, topics, ids, log, down: kill_leader(cluster, topics, log, down),
    "coordinator": lambda cluster, topics, ids, log, down: kill_coordinator(
        cluster, ids, log, down
    ),
    "both": kill_leader_and_coordinator,
    "rolling": lambda cluster, topics, ids, log, down: rolling_restart(cluster, log),
}


def ride_out(
    faults: list[str],
    db: psycopg.Connection[Any],
    database_url: str,
    outbox: Outbox,
    registry: SchemaFolder,
    cluster: LocalKafkaCluster,
    topic_prefix: str,
    while_down: WhileDown = None,
) -> tuple[Availability, list[str]]:
    """Two relays publish a 4-part subscriber while writers race and ``faults`` (names
    of :data:`FAULTS`) strike in turn; returns what the probe saw and the faults' log.
    Afterwards every event has been published."""
    wait_fully_replicated(cluster)
    subscriber = sub("s", topic_prefix, value_format="json", parts=PARTS)
    topic = topic_prefix + "outbox.event.order"
    relays = [
        Relay(
            load_settings(
                database_url=database_url,
                bootstrap_servers=cluster.bootstrap_servers,
                subscribers=[subscriber],
                poll_interval=0.2,
                metrics_port=0,
            ),
            registry=registry,
        )
        for _ in range(2)
    ]
    writers = Writers(database_url, outbox)
    probe = AvailabilityProbe(database_url, "s", lambda: [session_id(r) for r in relays])
    log: list[str] = []
    try:
        for relay in relays:
            relay.start()
        write_orders(db, outbox, [f"first-{i}" for i in range(40)])
        wait_caught_up(db, "s", timeout=60)  # the topic exists, every part publishes
        assert replicas(cluster, [topic, TRANSACTION_STATE]) == {3}
        ids = [f"outbox-relay.s.{p}.{subscriber_id(db)}" for p in range(PARTS)]
        writers.start()
        probe.start()
        for fault in faults:
            time.sleep(SETTLE_S)
            FAULTS[fault](cluster, [topic], ids, log, while_down)
        time.sleep(SETTLE_S)
        writers.stop()
        wait_caught_up(db, "s", timeout=120)
        return probe.stop(), log
    finally:
        try:
            writers.stop()
            probe.stop()
        finally:
            for relay in relays:
                relay.stop()


@pytest.mark.timeout(600)
def test_two_relays_ride_out_the_leader_and_the_coordinator_killed(
    db: psycopg.Connection[Any],
    database_url: str,
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

    seen, log = ride_out(
        ["both"], db, database_url, outbox, registry, kafka_cluster, topic_prefix, watch_while_down
    )
    # Transactional calls the watchdog gave up on (relay/kafka.py, _watched). A figure.
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
    _assert_exactly_once_in_key_order(db, kafka_cluster.bootstrap_servers, outbox_topic)


def subscriber_id(db: psycopg.Connection[Any]) -> str:
    row = db.execute("SELECT id FROM outbox_subscribers WHERE name = 's'").fetchone()
    assert row is not None
    return str(row[0])


def _assert_exactly_once_in_key_order(
    db: psycopg.Connection[Any], bootstrap: str, topic: str
) -> None:
    [report] = verify(db, "public", KafkaTopicReader({"bootstrap.servers": bootstrap}))
    assert (report.missing, report.duplicated, report.out_of_order) == (0, 0, 0), report.as_dict()
    assert report.found == report.expected
    rows = db.execute(
        "SELECT aggregate_id, message_id::text FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    records = consume(bootstrap, [topic], len(rows), timeout=60)
    assert len(records) == len(rows) == len({r.message_id for r in records})
    wanted: dict[str, list[str]] = {}
    for key, message_id in rows:
        wanted.setdefault(key, []).append(message_id)
    got = {key: [r.message_id for r in recs] for key, recs in by_key(records).items()}
    assert got == wanted


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
            lambda: any(r.name == "relay.replication_check" for r in caplog.records),
            what="the replication advice",
        )
    finally:
        relay.stop()
    advice = [r.getMessage() for r in caplog.records if r.name == "relay.replication_check"]
    assert any(checkpoints in a and "one replica" in a for a in advice), advice
    assert any("topic_replication_factor is 1" in a for a in advice), advice
