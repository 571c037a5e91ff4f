"""Cost growth with subscribers: 1 subscriber against 100 filtered ones, one relay process.

The outbox holds 100 aggregate types in turn; each of the 100 subscribers takes one of
them (``aggregate_types``) to its own topic, so together they publish every event once,
as the single unfiltered subscriber does. The figure is the aggregate rate (events
published per second, summed over subscribers) against the single subscriber's: at
1.0x, splitting a stream over filtered subscribers costs nothing.

Publishing is measured, not start-up: the subscribers are paused until every part has
started (its producer fenced, its Kafka-side checkpoint read), then resumed together.
Start-up, which a relay pays once, is its own figure: 100 parts each open a connection,
a transactional producer and a thread. The process's peak memory is in the details.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable

import psycopg

from bench.harness import (
    BATCH,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    add_subscribers,
    create_topics,
    fill_outbox,
    final_positions,
    wait_published,
)
from relay.localstack.process import free_port
from relay.subscribers import Subscriber

MANY = 100


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.fanout_events
    # The single subscriber drains as many events as the hundred publish in all, so
    # both clocks run long enough to mean something.
    one, one_start, one_mb = aggregate_rate(stack, events, 1)
    stack.fresh_broker()
    many, many_start, many_mb = aggregate_rate(stack, events, MANY)
    details = {"events": events, "events_per_subscriber": events // MANY,
               "peak_rss_mb_1": one_mb, f"peak_rss_mb_{MANY}": many_mb}  # fmt: skip
    return [
        Figure("fanout", f"aggregate ev/s, {MANY} filtered vs 1 subscriber", many, "ev/s", one,
               "1 subscriber", "ratio>=0.8", details),
        Figure("fanout", f"start-up s, {MANY} subscribers vs 1 (relay start to every part "
               "ready)", many_start, "s", one_start, "1 subscriber", None, details),
    ]  # fmt: skip


def aggregate_rate(stack: Stack, events: int, subscribers: int) -> tuple[float, float, float]:
    """The aggregate publishing rate, the start-up seconds and the peak RSS in MiB."""
    url = stack.database(f"fanout{subscribers}")
    fill_outbox(url, events, types=MANY)
    prefix = stack.topic_prefix(f"fanout{subscribers}")
    filters = [frozenset({f"order{i}"}) for i in range(subscribers)] if subscribers > 1 else [None]
    add_subscribers(
        url,
        [Subscriber(f"s{i}", topic=f"{prefix}.s{i}", aggregate_types=types)
         for i, types in enumerate(filters)],
    )  # fmt: skip
    targets = final_positions(url)
    # Created up front, as in production (deploy/README.md): creating 100 topics of 3
    # partitions is the broker's work, not publishing.
    create_topics(stack.bootstrap, [f"{prefix}.s{i}" for i in range(subscribers)], 3)
    set_all_paused(url, paused=True)
    port = free_port()
    with RelayProcesses(stack, url, f"fanout{subscribers}", batch_size=BATCH,
                        poll_interval=0.1, metrics_enabled=True, metrics_port=port) as relays:  # fmt: skip
        started = time.perf_counter()
        wait_all_paused(port, subscribers, relays.check_alive)
        startup = time.perf_counter() - started
        set_all_paused(url, paused=False)
        first, done = wait_published(url, targets, tick=relays.check_alive)
        peak = max(relays.peak_rss_mb())
    # The clock starts at the first checkpoint: one batch of one subscriber is not in it.
    return (events - BATCH // subscribers) / (done - first), startup, peak


def set_all_paused(url: str, *, paused: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE outbox_subscribers SET paused = %s", (paused,))


def wait_all_paused(port: int, parts: int, check: Callable[[], None], timeout: float = 600) -> None:
    """Wait until the relay's /metrics shows ``parts`` parts started and paused."""
    paused = re.compile(r'^outbox_relay_part_state\{.*state="paused".*\} 1\.0$', re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                body = r.read().decode()
        except OSError:
            body = ""  # not listening yet
        if len(paused.findall(body)) == parts:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{parts} parts did not start within {timeout:.0f}s")
