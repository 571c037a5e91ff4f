"""A sharded subscriber: its parts on one relay process, and on several.

* One process: a 4-part subscriber against a 1-part one, same rows. Each part has its
  own thread, connection and producer, so their waits on Postgres and Kafka overlap; the
  Python work of all of them shares one interpreter lock.
* Rows of other parts a part's poll reads (EXPLAIN ANALYZE, half-way through the
  backlog), per row it keeps: 0 when no part scans the rows of others (target).
* One relay of 2 worker processes (``run --workers 2``): the same 4 parts over two
  member processes, one per core (target: >= 1.6x).
* Several processes: parts are assigned round-robin over live relays, so 4 processes
  take one part each where 1 process runs all 4. On a 2-core machine shared with
  Postgres and the broker, that gain is bounded by the cores, not by the relay.

The four set-ups publish the same backlog, written once (each run through a new
subscriber reading from the beginning, to a new topic), and take turns,
``scale.repetitions`` rounds (bench/method.py), each run after an emptied broker, a
CHECKPOINT and a pause; figures are medians with their ranges.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.growth import poll_plan
from bench.harness import (
    BATCH,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    add_subscribers,
    fill_outbox,
    final_positions,
    fresh_subscribers,
    wait_published,
)
from bench.method import interleave, settle
from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import Subscriber

PARTS = 4
WORKERS = 2  # one per core of the benchmark machine


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.sharding_events
    url = stack.database("sharded")
    fill_outbox(url, events)

    def setup(parts: int, relays: int, workers: int = 1) -> Callable[[], float]:
        return lambda: rate(stack, url, events, parts=parts, relays=relays, workers=workers)

    def settled() -> None:
        stack.fresh_broker()
        settle(url)

    rates = interleave(
        {"single": setup(1, 1), "one": setup(PARTS, 1), "workers": setup(PARTS, 1, WORKERS),
         "several": setup(PARTS, PARTS)},
        scale.repetitions, before_each=settled,
    )  # fmt: skip
    single, one = rates["single"], rates["one"]
    plan = scan_per_row(stack, scale.events)
    return [
        Figure.of("sharding", f"{PARTS}-part subscriber ev/s vs 1 part, one process", one,
                  "ev/s", single, "1-part subscriber", "ratio>=1.6", {"events": events}),
        Figure.of("sharding", f"{PARTS}-part subscriber ev/s vs 1 part, one relay of "
                  f"{WORKERS} worker processes", rates["workers"], "ev/s", single,
                  "1-part subscriber", "ratio>=1.6", {"events": events, "workers": WORKERS}),
        Figure("sharding", "other parts' rows a poll reads per row it keeps", plan["others"],
               "", target="value<=0", details=plan),
        Figure.of("sharding", f"{PARTS}-part subscriber ev/s, {PARTS} processes vs 1",
                  rates["several"], "ev/s", one, "1 relay process", None, {"events": events}),
    ]  # fmt: skip


def rate(stack: Stack, url: str, events: int, *, parts: int, relays: int, workers: int) -> float:
    """One run over the backlog of ``url``, through a new subscriber and topic."""
    label = f"sharded{parts}x{relays}w{workers}"
    topic = f"{stack.topic_prefix('sharded')}.orders"
    name = label.replace("x", "_")
    fresh_subscribers(url, [Subscriber(name, topic=topic, parts=parts)])
    targets = final_positions(url)
    # Paused until the parts have spread over the relays: steady state is measured,
    # not the hand-overs of the first seconds (the first relay up claims every part).
    set_paused(url, name, paused=True)
    with RelayProcesses(
        stack, url, label, relays, batch_size=BATCH, heartbeat_interval=0.5, workers=workers
    ) as procs:
        wait_spread(url, parts, relays * workers, procs.check_alive)
        set_paused(url, name, paused=False)
        first, done = wait_published(url, targets, tick=procs.check_alive)
    return (events - parts * BATCH) / (done - first)


def scan_per_row(stack: Stack, events: int) -> dict[str, Any]:
    url = stack.database("sharded_plan")
    fill_outbox(url, events)
    add_subscribers(url, [Subscriber("sharded", topic="plan", parts=PARTS)])  # its indexes
    plan = poll_plan(url, events // 2, part=1, parts=PARTS)
    kept = min(BATCH, events // 2 // PARTS)
    return {"scanned": plan["scanned"], "kept": kept, "others": plan["others"] / kept,
            "ms": plan["ms"], "nodes": plan["nodes"]}  # fmt: skip


def set_paused(url: str, name: str, *, paused: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        OutboxStore(conn).set_paused(name, paused)


def wait_spread(
    url: str, parts: int, relays: int, check: Callable[[], None], timeout: float = 60
) -> None:
    """Wait until every part is claimed and by ``relays`` distinct relays."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            owned, owners = conn.execute(
                "SELECT count(owner), count(DISTINCT owner) FROM outbox_checkpoints"
            ).fetchone() or (0, 0)
            if owned == parts and owners == min(relays, parts):
                return
            check()
            time.sleep(0.1)
    raise TimeoutError(f"the parts did not spread over {relays} relays in {timeout:.0f}s")
