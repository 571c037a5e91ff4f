"""Test helpers: a real read_committed consumer, and the relay run in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from relay import Outbox

_WARMUP_S = 2.5


@dataclass(frozen=True)
class Seen:
    """A record as a consumer of the topic sees it."""

    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, str]

    @property
    def message_id(self) -> str:
        return self.headers["id"]


def wait_for_topics(bootstrap: str, topics: list[str], timeout: float = 30.0) -> dict[str, int]:
    """Partition count of each topic, once all exist."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        metadata = admin.list_topics(timeout=5).topics
        if all(t in metadata and metadata[t].partitions for t in topics):
            return {t: len(metadata[t].partitions) for t in topics}
        if time.monotonic() > deadline:
            missing = [t for t in topics if t not in metadata]
            raise AssertionError(f"topics never appeared: {missing}")
        time.sleep(0.1)


def consume(
    bootstrap: str,
    topics: list[str],
    expected: int,
    *,
    timeout: float = 30.0,
    quiet: float = 1.0,
    isolation: str = "read_committed",
) -> list[Seen]:
    """Read every partition of ``topics`` from the start, read_committed, until ``expected``
    records arrived and nothing more came for ``quiet`` seconds (so duplicates show up)."""
    partitions = wait_for_topics(bootstrap, topics, timeout)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-relay-tests",
            "isolation.level": isolation,
            "enable.auto.commit": False,
        }
    )
    consumer.assign(
        [TopicPartition(t, p, OFFSET_BEGINNING) for t, n in partitions.items() for p in range(n)]
    )
    seen: list[Seen] = []
    started = time.monotonic()
    deadline = started + timeout
    last_arrival = started
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(0.1)
            now = time.monotonic()
            if message is None:
                if len(seen) >= expected and now - last_arrival >= quiet:
                    break
                continue
            if message.error():
                raise AssertionError(f"consumer error: {message.error()}")
            last_arrival = now
            seen.append(_seen(message))
    finally:
        consumer.close()
    return seen


def nothing_arrives(bootstrap: str, topics: list[str], within: float) -> list[Seen]:
    """Whatever arrives on existing ``topics`` within ``within`` seconds (expect [])."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = [t for t in topics if t in admin.list_topics(timeout=5).topics]
    if not existing:
        time.sleep(within)
        return []
    return consume(bootstrap, existing, expected=0, timeout=within + 20, quiet=within)


def _seen(message: Any) -> Seen:
    headers = {k: (v.decode() if v is not None else "") for k, v in (message.headers() or [])}
    return Seen(
        message.topic(),
        message.partition(),
        message.offset(),
        message.key().decode(),
        message.value(),
        headers,
    )


def by_key(seen: list[Seen]) -> dict[str, list[Seen]]:
    """Records grouped by key, each group in the order a consumer of the partition sees them."""
    groups: dict[str, list[Seen]] = {}
    for record in sorted(seen, key=lambda s: (s.topic, s.partition, s.offset)):
        groups.setdefault(record.key, []).append(record)
    return groups


# -- writing demo events -----------------------------------------------------------


def order(i: int | str) -> dict[str, Any]:
    return {"order_id": str(i), "customer_id": "c", "amount_cents": len(str(i))}


def sub(name: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "topic": prefix + "outbox.event.{aggregate_type}", **extra}


def write_orders(
    conn: psycopg.Connection[Any], outbox: Outbox, ids: list[str], key: str | None = None
) -> None:
    for i in ids:
        outbox.append(
            conn,
            aggregate_type="order",
            aggregate_id=key or i,
            event_type="OrderPlaced",
            payload=order(i),
        )


def ids_of(seen: list[Seen]) -> list[str]:
    return [s.headers["id"] for s in seen]


# -- the relay, from outside ----------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``outbox-relay ARGS`` in a subprocess; its exit code is part of what tests check."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        check=False,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def caught_up(db: psycopg.Connection[Any], name: str) -> bool:
    """Every event of subscriber ``name`` is published (its lag is 0)."""
    from relay.store import OutboxStore

    store = OutboxStore(db)
    return store.get(name).lag(store) == 0


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def wait_caught_up(db: psycopg.Connection[Any], name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not caught_up(db, name):
        assert time.monotonic() < deadline, f"subscriber {name} never caught up"
        time.sleep(0.05)
