"""Faults on a local Kafka cluster, and what the relays' availability was through them.

Helpers for the cluster tests (test_cluster_availability.py, test_chaos.py's cluster
mode): which node leads a topic's partitions or coordinates a transactional id, killing
and restarting it, and an :class:`AvailabilityProbe` that samples the parts' owners and
checkpoints, and the relays' sessions, several times a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from relay.localstack import LocalKafkaCluster

TRANSACTION_STATE = "__transaction_state"
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
    #: Per relay, every session id seen (None: it held none for a moment).
    sessions: dict[int, set[str | None]] = field(default_factory=dict)
    samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "longest_gap_s": {p: round(g, 1) for p, g in sorted(self.longest_gap.items())},
            "longest_ownerless_s": round(self.longest_ownerless, 1),
            "ownerless_samples": self.ownerless_samples,
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
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._done.wait(self._every):
                now = time.monotonic()
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
                    ownerless_since = ownerless_since or now
                    self.seen.longest_ownerless = max(
                        self.seen.longest_ownerless, now - ownerless_since
                    )
                else:
                    ownerless_since = None
