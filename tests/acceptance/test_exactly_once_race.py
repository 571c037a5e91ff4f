"""The exactly-once race of issue #49, provoked on purpose on the three-node cluster.

Issue #49's account: a transaction failed after the partition leader appended one of its
batches without the producer learning so; the relay aborted it and ran the batch again
at the aborted transaction's epoch, where a record sent again under its old sequence
number is taken by the broker for a duplicate of the aborted batch and never appended,
and the retry's commit moved the checkpoint past records that exist only aborted. The
relay now retries on a new client of its transactional id, at the next epoch
(``TransactionalPublisher._next_epoch``, relay/adapters/kafka/kafka.py).

The window, opened each round while writers keep the part busy: the node leading the
topic's one partition (and coordinating none of the part's transactional ids) is
suspended (SIGSTOP) longer than ``message.timeout.ms``, then resumed before the brokers
fence it (a kill -9 and restart costs a JVM start a round: too slow to repeat here).
Records it appended but never acknowledged time out in the client, the transaction
aborts with them on the log, and the relay retries the batch. The test asserts that the window was hit (a retry
ran, and aborted records are on the log: rounds go on until they are), then reads the partition three ways: Kafka's
DumpLogSegments (each transaction's records, outcome and epoch: none of the outbox's
records only in aborted transactions, none committed twice), read_uncommitted and
read_committed readers, and ``verify``: every event exactly once, in per-key order.

What it measured (docs/design.md §5, "The race, provoked"): with the same-epoch retry
restored the old code lost nothing either, because librdkafka (2.16) marks a
transaction whose records timed out as requiring an epoch bump and bumps the epoch
itself when it aborts (KIP-360): every aborted transaction's successor ran at a later
epoch. The figures print with ``-s``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from confluent_kafka import ElectionType, Producer, TopicPartition
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from relay import Outbox
from relay.adapters.kafka.turns import second_transactional_id
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalKafka, LocalKafkaCluster
from tests.acceptance.cluster_faults import (
    TRANSACTION_STATE,
    Writers,
    admin,
    coordinators,
    delivery_problems,
    leaders,
    subscriber_id,
    wait_fully_replicated,
)
from tests.acceptance.partition_log import read_log, retries_after_aborts, transactions
from tests.support import Roles, consume, wait_caught_up, wait_until, write_orders

pytestmark = pytest.mark.cluster
_log = logging.getLogger(__name__)

ROUNDS = 12
# A round opens the window only when the leader took records in before it stopped (one
# CI run aborted 9 batches in 12 rounds, none after an append): rounds go on, four at a
# time, until the log holds an aborted transaction's records, up to this many.
MAX_ROUNDS = 40
# Records not acknowledged within this fail their transaction (message.timeout.ms).
MESSAGE_TIMEOUT_MS = 1000
# The relay's delivery_timeout, which also bounds each transactional call (at most 3 s):
# the abort must outlast the drain of the requests to the suspended leader, or the part
# starts over with a new producer instead of retrying (what the test is about).
DELIVERY_TIMEOUT_S = 3.0
# How long the leader stays suspended: past the delivery timeout, so the transaction
# aborts while its records wait in the leader's socket, and under the brokers' session
# timeout (3 s, relay/localstack/kafka.py), so that it mostly leads again on waking.
PAUSE_S = (1.4, 2.4)
SETTLE_S = 1.5  # publishing undisturbed between rounds


def _suspended(node: LocalKafka, seconds: float) -> None:
    """SIGSTOP ``node`` for ``seconds``, then SIGCONT it (whatever happens meanwhile)."""
    assert node.pid is not None, f"node {node.node_id} is not running"
    os.kill(node.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(node.pid, signal.SIGCONT)


def _lead_again(cluster: LocalKafkaCluster, topic: str, node: int) -> None:
    """Give the partition back to ``node`` (its preferred leader) once all its replicas
    are in sync: a node fenced in the last round leads nothing until then."""
    wait_fully_replicated(cluster)
    if node not in leaders(cluster, [topic]):
        client = admin(cluster)  # referenced until the election is answered
        client.elect_leaders(ElectionType.PREFERRED, [TopicPartition(topic, 0)]).result(30)
        wait_until(lambda: node in leaders(cluster, [topic]), what=f"node {node} leading")


def _topic_led_away_from(cluster: LocalKafkaCluster, topic: str, ids: list[str]) -> int:
    """Create ``topic`` (one partition, three replicas) led by a node that coordinates
    none of ``ids``: suspending it then stops the records, not the transaction calls."""
    busy = set(coordinators(cluster, ids))
    leader = next(n.node_id for n in cluster.nodes if n.node_id not in busy)
    others = [n.node_id for n in cluster.nodes if n.node_id != leader]
    client = admin(cluster)
    client.create_topics([NewTopic(topic, 1, replica_assignment=[[leader, *others]])])[
        topic
    ].result(30)
    return leader


def _state_log(cluster: LocalKafkaCluster, name: str) -> None:
    """Make sure the transaction state log exists (a fresh cluster creates it at the
    first init_transactions): where it leads decides where the topic may lead."""
    producer = Producer(
        {"bootstrap.servers": cluster.bootstrap_servers, "transactional.id": name, "logger": _log}
    )
    producer.init_transactions(60)
    wait_until(
        lambda: all(
            p.leader >= 0
            for p in admin(cluster)
            .list_topics(TRANSACTION_STATE, timeout=10)
            .topics[TRANSACTION_STATE]
            .partitions.values()
        ),
        what="the transaction state log led",
    )


def _window_hit(node: LocalKafka, topic: str) -> bool:
    """Whether ``node``'s log holds records of an aborted transaction."""
    return any(t.outcome == "ABORT" and t.batches for t in transactions(read_log(node, topic)))


def _registered(relay_url: str, name: str) -> bool:
    with psycopg.connect(relay_url, autocommit=True) as db:
        row = db.execute("SELECT 1 FROM outbox_subscribers WHERE name = %s", (name,))
        return row.fetchone() is not None


def _ids(relay_url: str, name: str) -> list[str]:
    with psycopg.connect(relay_url, autocommit=True) as db:
        first = f"outbox-relay.{name}.0.{subscriber_id(db)}"
    return [first, second_transactional_id(first)]


@pytest.mark.timeout(900)  # a ceiling for a loaded host; a loss costs the read 60 s more
def test_a_transaction_aborted_after_its_leader_appended_is_retried_without_loss(
    db: psycopg.Connection[Any],
    roles: Roles,
    outbox: Outbox,
    registry: SchemaFolder,
    kafka_cluster: LocalKafkaCluster,
    topic_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.kafka.kafka")
    wait_fully_replicated(kafka_cluster)
    _state_log(kafka_cluster, topic_prefix + "state-log")
    topic = topic_prefix + "race"
    relay = Relay(
        load_settings(
            database_url=roles.relay_url,
            bootstrap_servers=kafka_cluster.bootstrap_servers,
            subscribers=[{"name": "s", "topic": topic, "value_format": "json"}],
            delivery_timeout=DELIVERY_TIMEOUT_S,
            kafka={"message.timeout.ms": MESSAGE_TIMEOUT_MS},
            poll_interval=0.2,
            metrics_port=0,
        ),
        registry=registry,
    )
    writers = Writers(roles.writer_url, outbox)
    rng = random.Random(49)
    log: list[str] = []
    relay.start()
    try:
        # The part's ids are known once the relay registered its subscriber; the topic is
        # placed before its first row makes the relay create it.
        wait_until(lambda: _registered(roles.relay_url, "s"), what="the subscriber")
        leader = _topic_led_away_from(kafka_cluster, topic, _ids(roles.relay_url, "s"))
        with psycopg.connect(roles.writer_url, autocommit=True) as writer:
            write_orders(writer, outbox, [f"first-{i}" for i in range(20)])
        wait_caught_up(db, "s", timeout=120)  # a fresh cluster on a loaded host is slow
        writers.start()
        for n in range(MAX_ROUNDS):
            _lead_again(kafka_cluster, topic, leader)
            time.sleep(SETTLE_S)
            pause = rng.uniform(*PAUSE_S)
            _suspended(kafka_cluster.node(leader), pause)
            log.append(f"round {n}: node {leader} suspended {pause:.1f}s")
            checked = n + 1 >= ROUNDS and (n + 1) % 4 == 0
            if checked and _window_hit(kafka_cluster.node(leader), topic):
                break
        writers.stop()
        wait_fully_replicated(kafka_cluster)
        wait_caught_up(db, "s", timeout=120)
    finally:
        if writers.is_alive():  # a failure before they started has nothing to stop
            writers.stop()
        relay.stop()
    retried = sum(getattr(r, "event", None) == "kafka_txn_aborted_retrying" for r in caplog.records)
    rows = db.execute("SELECT count(*) FROM outbox").fetchone()
    assert rows is not None
    raw = consume(
        kafka_cluster.bootstrap_servers, [topic], rows[0], timeout=60, isolation="read_uncommitted"
    )
    committed = consume(kafka_cluster.bootstrap_servers, [topic], rows[0], timeout=60)
    raw_ids = Counter(r.message_id for r in raw)
    committed_ids = Counter(r.message_id for r in committed)
    lost = [m for m in raw_ids if m not in committed_ids]
    ended = transactions(read_log(kafka_cluster.node(leader), topic))
    same_epoch, next_epoch = retries_after_aborts(ended)
    on_disk = Counter(p for t in ended if t.outcome == "COMMIT" for p in t.payloads)
    only_aborted = {p for t in ended if t.outcome == "ABORT" for p in t.payloads} - set(on_disk)
    figures = {
        "rounds": log,
        "events": rows[0],
        "aborted_and_retried": retried,
        "records_in_log": len(raw),
        "aborted_copies": len(raw) - len(committed),
        "aborted_transactions": sum(t.outcome == "ABORT" and bool(t.batches) for t in ended),
        "retried_at_the_same_epoch": same_epoch,
        "retried_at_a_later_epoch": next_epoch,
        "lost": len(lost),
        "only_aborted_on_disk": len(only_aborted),
        "committed_twice_on_disk": sum(c > 1 for c in on_disk.values()),
        "duplicated": sum(c > 1 for c in committed_ids.values()),
    }
    print(json.dumps(figures, indent=2))
    assert retried > 0, figures  # the abort-retry path ran
    assert len(raw) > len(committed), figures  # the leader appended aborted records
    assert lost == [] and not only_aborted, figures
    assert sum(on_disk.values()) == len(committed) == rows[0], figures
    assert delivery_problems(db, kafka_cluster.bootstrap_servers, topic) == []
