"""A sharded subscriber (3 parts) published by 1 relay process against 3.

Parts are assigned round-robin over live relays, so 3 processes take one part each
where 1 process runs all 3. On a 2-core machine shared with Postgres and the broker,
the gain is bounded by the cores, not by the relay.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from bench.harness import (
    BATCH,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    add_subscribers,
    fill_outbox,
    final_positions,
    wait_published,
)
from relay.store import OutboxStore
from relay.subscribers import Subscriber

PARTS = 3


def run(stack: Stack, scale: Scale) -> list[Figure]:
    one = rate(stack, scale.events, relays=1)
    stack.fresh_broker()
    three = rate(stack, scale.events, relays=3)
    return [
        Figure("sharding", f"{PARTS}-part subscriber ev/s, 3 relays vs 1", three, "ev/s", one,
               "1 relay process", None, {"events": scale.events}),
    ]  # fmt: skip


def rate(stack: Stack, events: int, *, relays: int) -> float:
    url = stack.database(f"sharded{relays}")
    fill_outbox(url, events)
    topic = f"{stack.topic_prefix('sharded')}.orders"
    add_subscribers(url, [Subscriber("sharded", topic=topic, parts=PARTS)])
    targets = final_positions(url)
    # Paused until the parts have spread over the relays: steady state is measured,
    # not the hand-overs of the first seconds (the first relay up claims every part).
    set_paused(url, "sharded", paused=True)
    with RelayProcesses(
        stack, url, f"sharded{relays}", relays, batch_size=BATCH, heartbeat_interval=0.5
    ) as procs:
        wait_spread(url, relays, procs.check_alive)
        set_paused(url, "sharded", paused=False)
        first, done = wait_published(url, targets, tick=procs.check_alive)
    return (events - PARTS * BATCH) / (done - first)


def set_paused(url: str, name: str, *, paused: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        OutboxStore(conn).set_paused(name, paused)


def wait_spread(url: str, relays: int, check: Callable[[], None], timeout: float = 60) -> None:
    """Wait until every part is claimed and by ``relays`` distinct relays."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            owned, owners = conn.execute(
                "SELECT count(owner), count(DISTINCT owner) FROM outbox_checkpoints"
            ).fetchone() or (0, 0)
            if owned == PARTS and owners == min(relays, PARTS):
                return
            check()
            time.sleep(0.1)
    raise TimeoutError(f"the parts did not spread over {relays} relays in {timeout:.0f}s")
