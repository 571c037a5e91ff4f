"""Bounded producers and threads (issue #30): a relay of many idle subscribers holds no
producer and no thread per part, and publishes what comes exactly once on a few
producers. Threads are counted from /proc (librdkafka's native threads included)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon import Relay
from tests.support import consume, wait_until

SUBSCRIBERS = 200
MAX_PRODUCERS = 4
# The relay's own threads (supervisor, session keeper, commit probe, broker watch,
# scheduler, and the HTTP servers' pools: scrapes and probes on the metrics port,
# probes on the probe port, #47) and, per producer, librdkafka's (main, broker and
# internal threads), its commit helper and its call thread (#31): far below one per
# part. On two cores 65 were counted, 2 of them the probe port's (issue #47).
MAX_NEW_THREADS = 80


def _threads() -> int:
    """Threads of this process, native ones included."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(600)
def test_a_relay_of_200_idle_subscribers_holds_few_producers_and_threads(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    start_relay: Any,
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    store = OutboxStore(db)
    for n in range(SUBSCRIBERS):
        store.add(
            Subscriber(
                f"s{n:03d}",
                topic=f"{topic_prefix}t{n:03d}",
                value_format=ValueFormat.JSON,
                aggregate_types=frozenset({f"type{n:03d}"}),
            )
        )
    before = _threads()
    relay: Relay = start_relay(max_producers=MAX_PRODUCERS, topic_partitions=1)
    wait_until(lambda: len(relay.workers) == SUBSCRIBERS, timeout=120, what="every part claimed")
    wait_until(
        lambda: all(s == "running" for s in relay.part_states().values()),
        timeout=120,
        what="every part polled",
    )
    idle_threads = _threads() - before
    assert idle_threads < MAX_NEW_THREADS, f"{idle_threads} threads for {SUBSCRIBERS} idle parts"
    # Each part recovered as it started; no more producers than the bound stay open.
    assert relay.parts.producers.open <= MAX_PRODUCERS

    outbox = Outbox(None)
    busy = [0, 57, 101, 150, 199, 3]  # more parts than producers
    ids = []
    with writer_db.transaction():
        for n in busy:
            for i in range(5):
                ids.append(
                    str(
                        outbox.append(
                            writer_db,
                            aggregate_type=f"type{n:03d}",
                            aggregate_id=f"a{i}",
                            event_type="Happened",
                            payload={"n": n, "i": i},
                        )
                    )
                )
    topics = [f"{topic_prefix}t{n:03d}" for n in busy]
    seen = consume(kafka_bootstrap, topics, len(ids), timeout=120, quiet=2.0)
    published = Counter(r.message_id for r in seen)
    assert set(published) == set(ids) and max(published.values()) == 1
    assert relay.parts.producers.open <= MAX_PRODUCERS
    busy_threads = _threads() - before
    assert busy_threads < MAX_NEW_THREADS, f"{busy_threads} threads after publishing"
