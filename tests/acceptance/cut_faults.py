"""One relay cut from Postgres, from Kafka, or both, by a black hole (issue #49 item 2).

Helpers for tests/acceptance/test_cut_relay.py and bench/cut.py. Two in-process relays
(as the relay role) publish a 4-part subscriber while writers (as the writer role) race;
the first relay reaches Postgres and Kafka through :class:`tests.black_hole.BlackHole`
proxies, the second directly. A cut stops the proxies' traffic without closing a socket
(what a dropped-packet firewall does); the heal delivers what was held, late.

Kafka has a listener of its own for the cut relay, ``CUT``, whose advertised address is
the proxy: the relay's bootstrap and every broker address its metadata names go through
the proxy, while the other relay, the writers' checks and the test's consumer use the
plain listener.

A part's stall is measured from outside the relays, by a ``read_committed`` consumer of
the topic: for each part, the longest time between two of its records arriving, from the
cut until the run settles after the heal (a record a zombie's open transaction hides is
not there yet, so a pinned last stable offset counts, as a reader sees it). Writers keep
every part busy (some 50 events a second each), so any gap over a second is a stall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from relay import Outbox
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalKafka, free_port
from tests.acceptance.cluster_faults import KEYS, PARTS, Writers
from tests.black_hole import BlackHole
from tests.support import session_id, sub, wait_caught_up, wait_for_topics, write_orders

#: What each fault cuts the first relay from.
FAULTS: dict[str, tuple[str, ...]] = {
    "kafka": ("kafka",),
    "postgres": ("postgres",),
    "both": ("kafka", "postgres"),
}
SETTLE_S = 5.0  # publishing undisturbed before each cut
AFTER_HEAL_S = 15.0  # the cut relay back and given its share again, within the window


@contextmanager
def kafka_with_cut_listener(work_dir: Path) -> Iterator[tuple[LocalKafka, BlackHole]]:
    """A single-node Kafka with a second listener, ``CUT``, advertised at a black hole's
    address: clients bootstrapped at the hole's address reach the broker only through it."""
    port, controller, cut_port = free_port(), free_port(), free_port()
    with BlackHole(("127.0.0.1", cut_port)) as hole:
        broker = LocalKafka(
            work_dir,
            port=port,
            config={
                "listeners": (
                    f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
                    f"CUT://127.0.0.1:{cut_port}"
                ),
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},CUT://{hole.address}",
                "listener.security.protocol.map": (
                    "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,CUT:PLAINTEXT"
                ),
                "controller.quorum.voters": f"1@127.0.0.1:{controller}",
            },
        )
        broker.start()
        try:
            yield broker, hole
        finally:
            broker.stop()


@contextmanager
def postgres_hole(url: str) -> Iterator[tuple[BlackHole, str]]:
    """A black hole in front of ``url``'s server, and ``url`` through it."""
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    with BlackHole((parts.hostname, parts.port)) as hole:
        login = parts.netloc.rpartition("@")[0]
        netloc = f"{login}@{hole.address}" if login else hole.address
        yield hole, urlunsplit(parts._replace(netloc=netloc))


class PartArrivals(threading.Thread):
    """A ``read_committed`` consumer of ``topic`` noting when each part's records arrive:
    per part, the longest time between two arrivals since :meth:`mark`."""

    def __init__(self, bootstrap: str, topic: str, part_of: dict[str, int]) -> None:
        super().__init__(name="part-arrivals", daemon=True)
        self._servers = bootstrap
        self._topic = topic
        self._part_of = part_of
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self._longest: dict[int, float] = {}
        self.records = 0

    def mark(self) -> None:
        """Begin a new window: the longest gaps start over (from each part's last arrival)."""
        with self._lock:
            self._longest = {}

    def longest(self) -> dict[int, float]:
        """Per part, the longest gap in the window so far, the current one included."""
        assert self.is_alive(), "the consumer stopped"
        now = time.monotonic()
        with self._lock:
            # A part never seen stalled all along: as long as the window, at least.
            return {
                part: max(self._longest.get(part, 0.0), now - self._last.get(part, 0.0))
                for part in range(PARTS)
            }

    def stop(self) -> None:
        self._done.set()
        self.join(30)

    def run(self) -> None:
        wait_for_topics(self._servers, [self._topic])
        reader = KafkaTopicReader(
            {"bootstrap.servers": self._servers}, group="cut-arrivals", isolation="read_committed"
        )
        with closing(reader.follow([self._topic])) as records:
            for record in records:
                if self._done.is_set():
                    return
                key = None if record is None or record.key is None else record.key.decode()
                if key in self._part_of:  # the writers' keys, not the warm-up's
                    self._arrived(self._part_of[key])

    def _arrived(self, part: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.records += 1
            if part in self._last:
                gap = now - self._last[part]
                self._longest[part] = max(self._longest.get(part, 0.0), gap)
            self._last[part] = now


@dataclass
class Cut:
    """One fault as the consumer saw it."""

    fault: str
    #: Per part, the longest time (s) between two of its records reaching the consumer,
    #: from the cut until AFTER_HEAL_S after the heal.
    longest_gap: dict[int, float]
    #: Per part, its longest gap while the relay was cut (the heal's handover excluded).
    longest_gap_cut: dict[int, float]
    cut_s: float


@dataclass
class Rides:
    cuts: list[Cut] = field(default_factory=list)
    written: int = 0
    log: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Holes:
    """The black holes in front of the first relay's servers, and its addresses."""

    kafka: BlackHole
    postgres: BlackHole
    bootstrap: str  # through kafka
    relay_url: str  # through postgres


def parts_of_keys(owner: psycopg.Connection[Any]) -> dict[str, int]:
    """The part of each writer key, as the outbox computes it."""
    rows = owner.execute(
        "SELECT k, public.outbox_part(k, %s) FROM pg_catalog.unnest(%s::text[]) AS k",
        (PARTS, KEYS),
    ).fetchall()
    return {key: part for key, part in rows}


def ride_out_cuts(
    faults: list[str],
    relay_url: str,
    writer_url: str,
    owner: psycopg.Connection[Any],
    outbox: Outbox,
    registry: SchemaFolder,
    kafka: LocalKafka,
    holes: Holes,
    topic_prefix: str,
    *,
    cut_for: float,
    per_transaction: int = 4,
) -> Rides:
    """Two relays publish while writers race and each of ``faults`` (names of
    :data:`FAULTS`) cuts the first relay for ``cut_for`` seconds; afterwards every event
    has been published. Returns what the consumer saw of each cut."""
    subscriber = sub("s", topic_prefix, value_format="json", parts=PARTS)
    topic = topic_prefix + "outbox.event.order"
    addresses = [(holes.relay_url, holes.bootstrap), (relay_url, kafka.bootstrap_servers)]
    relays = [
        Relay(
            load_settings(
                database_url=url,
                bootstrap_servers=bootstrap,
                subscribers=[subscriber],
                poll_interval=0.2,
                metrics_port=0,
            ),
            registry=registry,
        )
        for url, bootstrap in addresses
    ]
    writers = Writers(writer_url, outbox, per_transaction)
    arrivals = PartArrivals(kafka.bootstrap_servers, topic, parts_of_keys(owner))
    rides = Rides()
    try:
        for relay in relays:
            relay.start()
        with psycopg.connect(writer_url, autocommit=True) as writer:
            write_orders(writer, outbox, [f"first-{i}" for i in range(40)])
        with psycopg.connect(relay_url, autocommit=True) as db:
            wait_caught_up(db, "s", timeout=60)  # the topic exists, every part publishes
            arrivals.start()
            writers.start()
            for fault in faults:
                _wait_both_serve(db, relays)
                time.sleep(SETTLE_S)
                rides.cuts.append(_cut(fault, holes, arrivals, cut_for, rides.log))
            writers.stop()
            rides.written = writers.committed
            wait_caught_up(db, "s", timeout=120)
        return rides
    finally:
        try:
            for thread in (writers, arrivals):
                if thread.ident is not None:  # started
                    thread.stop()
        finally:
            holes.kafka.heal()
            holes.postgres.heal()
            for relay in relays:
                relay.stop()


def _wait_both_serve(db: psycopg.Connection[Any], relays: list[Relay]) -> None:
    """Until each relay holds a session and owns two parts (the cut relay back)."""
    deadline = time.monotonic() + 90
    while True:
        sessions = [session_id(r) for r in relays]
        owners = [
            str(o)
            for (o,) in db.execute(
                "SELECT owner FROM outbox_checkpoints WHERE subscriber = 's'"
            ).fetchall()
        ]
        if None not in sessions and all(owners.count(str(s)) == PARTS // 2 for s in sessions):
            return
        assert time.monotonic() < deadline, f"relays never shared the parts: {owners}"
        time.sleep(0.2)


def _cut(fault: str, holes: Holes, arrivals: PartArrivals, cut_for: float, log: list[str]) -> Cut:
    cut = [holes.kafka if name == "kafka" else holes.postgres for name in FAULTS[fault]]
    log.append(f"{time.strftime('%X')} cut the first relay from {fault}")
    arrivals.mark()
    for hole in cut:
        hole.cut()
    time.sleep(cut_for)
    during = arrivals.longest()
    for hole in cut:
        hole.heal()
    log.append(f"{time.strftime('%X')} healed {fault}")
    time.sleep(AFTER_HEAL_S)
    return Cut(fault, arrivals.longest(), during, cut_for)
