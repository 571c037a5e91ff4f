"""Faults on a local Kafka cluster, and what the relays' availability was through them.

Helpers for the cluster tests (test_cluster_availability.py, test_chaos.py's cluster
mode) and the cluster benchmark (bench/cluster.py): which node leads a topic's
partitions or coordinates a transactional id, killing and restarting it, an
:class:`AvailabilityProbe` that samples the parts' owners and checkpoints, and the
relays' sessions, several times a second, and :func:`ride_out`, two relays publishing
through named :data:`FAULTS` while writers race.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from relay import Outbox
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.kafka.turns import second_transactional_id
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.verify_queries import PostgresVerifyOutbox
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalKafkaCluster
from relay.ops.verify import verify
from tests.support import (
    Roles,
    by_key,
    consume,
    order,
    session_id,
    sub,
    wait_caught_up,
    write_orders,
)

TRANSACTION_STATE = "__transaction_state"
PARTS = 4
KEYS = [f"k{i}" for i in range(40)]
DOWN_FOR_S = 6.0  # a node stays dead this long before it restarts (the tests)
SETTLE_S = 5.0  # publishing undisturbed before and after each fault
_log = logging.getLogger(__name__)


def admin(cluster: LocalKafkaCluster) -> AdminClient:
    """An admin client of ``cluster`` whose own lines go to ``logging`` (not stderr, where
    they outlive the cluster's nodes at the end of a session)."""
    return AdminClient({"bootstrap.servers": cluster.bootstrap_servers, "logger": _log})


def _java_hash(text: str) -> int:
    """Java's ``String.hashCode`` (Kafka maps a transactional id to its partition of the
    transaction state log with it)."""
    units = text.encode("utf-16-be")
    h = 0
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def leaders(cluster: LocalKafkaCluster, topics: Iterable[str]) -> Counter[int]:
    """How many partitions of ``topics`` each node leads."""
    metadata = admin(cluster).list_topics(timeout=10)
    return Counter(
        p.leader for t in topics for p in metadata.topics[t].partitions.values() if p.leader >= 0
    )


def replicas(cluster: LocalKafkaCluster, topics: Iterable[str]) -> set[int]:
    """The replication factors of ``topics``' partitions."""
    metadata = admin(cluster).list_topics(timeout=10)
    return {len(p.replicas) for t in topics for p in metadata.topics[t].partitions.values()}


def coordinators(cluster: LocalKafkaCluster, transactional_ids: Iterable[str]) -> Counter[int]:
    """How many of ``transactional_ids`` each node coordinates: the leader of the
    transaction state log's partition for the id."""
    partitions = admin(cluster).list_topics(TRANSACTION_STATE, timeout=10)
    state = partitions.topics[TRANSACTION_STATE].partitions
    return Counter(
        state[(_java_hash(t) & 0x7FFFFFFF) % len(state)].leader for t in transactional_ids
    )


def wait_fully_replicated(cluster: LocalKafkaCluster, timeout: float = 120.0) -> None:
    """Until every partition of every topic has a leader and all its replicas in sync."""
    client = admin(cluster)
    deadline = time.monotonic() + timeout
    while True:
        try:
            metadata = client.list_topics(timeout=5)
            lagging = [
                (t.topic, p.id)
                for t in metadata.topics.values()
                for p in t.partitions.values()
                if p.leader < 0 or len(p.isrs) < len(p.replicas)
            ]
        except KafkaException as exc:  # a node still starting: ask again
            lagging = [("?", str(exc))]
        if not lagging:
            return
        assert time.monotonic() < deadline, f"not fully replicated: {lagging[:5]}"
        time.sleep(0.5)


def kill_and_restart(
    cluster: LocalKafkaCluster,
    node_id: int,
    down_for: float,
    log: list[str],
    what: str,
    while_down: Callable[[int], object] | None = None,
) -> None:
    """``kill -9`` node ``node_id``, run ``while_down(node_id)``, start the node again
    ``down_for`` seconds after the kill, and wait until every partition is back in sync."""
    node = cluster.node(node_id)
    log.append(f"{time.strftime('%X')} kill -9 node {node_id} ({what})")
    node.kill()
    killed = time.monotonic()
    if while_down is not None:
        while_down(node_id)
    time.sleep(max(0.0, killed + down_for - time.monotonic()))
    node.start()
    wait_fully_replicated(cluster)
    log.append(f"{time.strftime('%X')} node {node_id} back in sync")


def rolling_restart(cluster: LocalKafkaCluster, log: list[str]) -> None:
    """Restart every node in turn (controlled shutdown), each back in sync before the next."""
    for node in cluster.nodes:
        log.append(f"{time.strftime('%X')} restarting node {node.node_id}")
        node.stop()
        node.start()
        wait_fully_replicated(cluster)
    log.append(f"{time.strftime('%X')} rolling restart done")


@dataclass
class Availability:
    """What the probe saw."""

    #: Per part, the longest time (s) between two moves of its checkpoint.
    longest_gap: dict[int, float] = field(default_factory=dict)
    #: The longest time (s) no part had an owner while some relay was alive.
    longest_ownerless: float = 0.0
    #: Samples in which no part had an owner while some relay was alive.
    ownerless_samples: int = 0
    #: The total time (s) no part had an owner while some relay was alive.
    ownerless_s: float = 0.0
    #: Per relay, every session id seen (None: it held none for a moment).
    sessions: dict[int, set[str | None]] = field(default_factory=dict)
    samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "longest_gap_s": {p: round(g, 1) for p, g in sorted(self.longest_gap.items())},
            "longest_ownerless_s": round(self.longest_ownerless, 1),
            "ownerless_samples": self.ownerless_samples,
            "ownerless_s": round(self.ownerless_s, 1),
            "samples": self.samples,
        }


class AvailabilityProbe(threading.Thread):
    """Samples subscriber ``name``'s parts every ``every`` seconds while writers keep every
    part busy: a checkpoint that does not move is a part that does not publish.

    ``sessions`` returns each live relay's session id (None while it holds none); an
    empty list means no relay is alive, when an ownerless moment is no fault. It returns
    None outside the moments to judge (gaps and owners are then not counted).
    """

    def __init__(
        self,
        url: str,
        name: str,
        sessions: Callable[[], list[str | None] | None],
        every: float = 0.1,
    ) -> None:
        super().__init__(name="availability-probe", daemon=True)
        self._url = url
        self._name = name
        self._sessions = sessions
        self._every = every
        self._done = threading.Event()
        self.seen = Availability()

    def stop(self) -> Availability:
        self._done.set()
        self.join(10)
        return self.seen

    def run(self) -> None:
        moved: dict[int, tuple[Any, float]] = {}
        ownerless_since: float | None = None
        previous = time.monotonic()
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._done.wait(self._every):
                now = time.monotonic()
                since_previous, previous = now - previous, now
                relays = self._sessions()
                rows = conn.execute(
                    "SELECT part, transaction_id::text, position, owner FROM outbox_checkpoints"
                    " WHERE subscriber = %s",
                    (self._name,),
                ).fetchall()
                for part, txid, position, _ in rows:
                    last = moved.get(part)
                    if last is None or last[0] != (txid, position):
                        moved[part] = ((txid, position), now)
                if relays is None:
                    ownerless_since = None
                    continue
                self.seen.samples += 1
                for i, session in enumerate(relays):
                    self.seen.sessions.setdefault(i, set()).add(session)
                for part, (_, since) in moved.items():
                    gap = max(self.seen.longest_gap.get(part, 0.0), now - since)
                    self.seen.longest_gap[part] = gap
                if relays and rows and all(owner is None for *_, owner in rows):
                    self.seen.ownerless_samples += 1
                    # From the first ownerless sample on, as longest_ownerless counts.
                    self.seen.ownerless_s += since_previous if ownerless_since else 0.0
                    ownerless_since = ownerless_since or now
                    self.seen.longest_ownerless = max(
                        self.seen.longest_ownerless, now - ownerless_since
                    )
                else:
                    ownerless_since = None


# -- two relays riding out faults, with writers racing -----------------------------------


class Writers(threading.Thread):
    """App transactions of ``per_transaction`` events each, one every 20 ms or so (4:
    about 200 events a second), until stopped."""

    def __init__(self, url: str, outbox: Outbox, per_transaction: int = 4) -> None:
        super().__init__(name="writers", daemon=True)
        self._url = url
        self._outbox = outbox
        self._per_transaction = per_transaction
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
                    for _ in range(self._per_transaction):
                        key = rng.choice(KEYS)
                        self._outbox.append(
                            conn,
                            aggregate_type="order",
                            aggregate_id=key,
                            event_type="OrderPlaced",
                            payload=order(f"{key}-{rng.randrange(10**9)}"),
                        )
                self.committed += self._per_transaction


WhileDown = Callable[[int], object] | None


def kill_leader(
    cluster: LocalKafkaCluster,
    topics: list[str],
    log: list[str],
    while_down: WhileDown = None,
    down_for: float = DOWN_FOR_S,
) -> None:
    """``kill -9`` the node leading most partitions of ``topics``; restart it later."""
    leader = leaders(cluster, topics).most_common(1)[0][0]
    kill_and_restart(cluster, leader, down_for, log, f"leads most of {topics[0]}", while_down)


def kill_coordinator(
    cluster: LocalKafkaCluster,
    ids: list[str],
    log: list[str],
    while_down: WhileDown = None,
    down_for: float = DOWN_FOR_S,
) -> None:
    """``kill -9`` the node coordinating most of ``ids``; restart it later."""
    coordinator = coordinators(cluster, ids).most_common(1)[0][0]
    kill_and_restart(cluster, coordinator, down_for, log, "coordinates most producers", while_down)


def kill_leader_and_coordinator(
    cluster: LocalKafkaCluster,
    topics: list[str],
    ids: list[str],
    log: list[str],
    while_down: WhileDown = None,
    down_for: float = DOWN_FOR_S,
) -> None:
    """``kill -9`` the node coordinating most of ``ids`` when it also leads partitions of
    ``topics`` (one kill, both faults: each node leads about a third of the partitions);
    otherwise the leader, then the coordinator."""
    led = leaders(cluster, topics)
    ranked = coordinators(cluster, ids).most_common()
    node = ranked[0][0]
    if led[node] == 0:
        kill_leader(cluster, topics, log, while_down, down_for)
        kill_coordinator(cluster, ids, log, while_down, down_for)
        return
    what = f"coordinates {ranked[0][1]} of {len(ids)} producers, leads {led[node]} partitions"
    kill_and_restart(cluster, node, down_for, log, what, while_down)


#: (cluster, the topics written, the parts' producers' transactional ids, the log, while_down,
#: how long a killed node stays down)
Fault = Callable[[LocalKafkaCluster, list[str], list[str], list[str], WhileDown, float], None]
FAULTS: dict[str, Fault] = {
    "leader": lambda cluster, topics, ids, log, down, down_for: kill_leader(
        cluster, topics, log, down, down_for
    ),
    "coordinator": lambda cluster, topics, ids, log, down, down_for: kill_coordinator(
        cluster, ids, log, down, down_for
    ),
    "both": kill_leader_and_coordinator,
    "rolling": lambda cluster, topics, ids, log, down, down_for: rolling_restart(cluster, log),
}


@dataclass
class Ridden:
    """What :func:`ride_out` saw: the probe's figures, the faults' log, the writers'."""

    seen: Availability
    log: list[str]
    written: int
    writing_s: float


def ride_out(
    faults: list[str],
    roles: Roles,
    outbox: Outbox,
    registry: SchemaFolder,
    cluster: LocalKafkaCluster,
    topic_prefix: str,
    while_down: WhileDown = None,
    *,
    down_for: float = DOWN_FOR_S,
    per_transaction: int = 4,
) -> Ridden:
    """Two relays (as the relay role) publish a 4-part subscriber while writers (as the
    writer role) race and ``faults`` (names of :data:`FAULTS`) strike in turn, a killed
    node down for ``down_for`` seconds. Afterwards every event has been published."""
    wait_fully_replicated(cluster)
    subscriber = sub("s", topic_prefix, value_format="json", parts=PARTS)
    topic = topic_prefix + "outbox.event.order"
    relays = [
        Relay(
            load_settings(
                database_url=roles.relay_url,
                bootstrap_servers=cluster.bootstrap_servers,
                subscribers=[subscriber],
                poll_interval=0.2,
                metrics_port=0,
            ),
            registry=registry,
        )
        for _ in range(2)
    ]
    writers = Writers(roles.writer_url, outbox, per_transaction)
    probe = AvailabilityProbe(roles.relay_url, "s", lambda: [session_id(r) for r in relays])
    log: list[str] = []
    try:
        for relay in relays:
            relay.start()
        with psycopg.connect(roles.relay_url, autocommit=True) as db:
            with psycopg.connect(roles.writer_url, autocommit=True) as writer:
                write_orders(writer, outbox, [f"first-{i}" for i in range(40)])
            wait_caught_up(db, "s", timeout=60)  # the topic exists, every part publishes
            assert replicas(cluster, [topic, TRANSACTION_STATE]) == {3}
            firsts = [f"outbox-relay.s.{p}.{subscriber_id(db)}" for p in range(PARTS)]
            ids = [*firsts, *map(second_transactional_id, firsts)]  # producers taking turns
            writers.start()
            started = time.monotonic()
            probe.start()
            for fault in faults:
                time.sleep(SETTLE_S)
                FAULTS[fault](cluster, [topic], ids, log, while_down, down_for)
            time.sleep(SETTLE_S)
            writers.stop()
            writing_s = time.monotonic() - started
            wait_caught_up(db, "s", timeout=120)
        return Ridden(probe.stop(), log, writers.committed, writing_s)
    finally:
        try:
            writers.stop()
            probe.stop()
        finally:
            for relay in relays:
                relay.stop()


def subscriber_id(db: psycopg.Connection[Any]) -> str:
    row = db.execute("SELECT id FROM outbox_subscribers WHERE name = 's'").fetchone()
    assert row is not None
    return str(row[0])


def delivery_problems(db: psycopg.Connection[Any], bootstrap: str, topic: str) -> list[str]:
    """What is wrong with how the outbox's rows reached ``topic``: `verify`'s report, then
    a read of the topic for duplicates and per-key order. None: every event exactly once,
    in per-key database order."""
    problems: list[str] = []
    reader = KafkaTopicReader({"bootstrap.servers": bootstrap})
    [report] = verify(OutboxStore(db), PostgresVerifyOutbox(db), reader)
    if (report.missing, report.duplicated, report.out_of_order) != (0, 0, 0) or (
        report.found != report.expected
    ):
        problems.append(f"verify: {report.as_dict()}")
    rows = db.execute(
        "SELECT aggregate_id, message_id::text FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    records = consume(bootstrap, [topic], len(rows), timeout=60)
    distinct = len({r.message_id for r in records})
    if not len(records) == len(rows) == distinct:
        problems.append(f"{len(rows)} rows, {len(records)} records, {distinct} distinct ids")
    wanted: dict[str, list[str]] = {}
    for key, message_id in rows:
        wanted.setdefault(key, []).append(message_id)
    got = {key: [r.message_id for r in recs] for key, recs in by_key(records).items()}
    if got != wanted:
        keys = sorted(k for k in wanted.keys() | got.keys() if got.get(k) != wanted.get(k))
        problems.append(f"{len(keys)} keys not in database order: {keys[:5]}")
    return problems
