"""Bounded resources (issue #30): a relay of many subscribers, and one part's throughput
against the code before producers were pooled.

* **1,000 filtered subscribers on one relay.** Each takes one aggregate type of 1,000 to
  a topic of its own (one partition, created up front). One ``outbox-relay run``
  process starts with every subscriber paused; start-up is the time from the process's
  start to every part reporting itself paused on /metrics. Then they are resumed and
  publish the backlog; the figures are the process's peak RSS (VmHWM) and the most
  threads it ran (``Threads:`` of /proc/<pid>/status, librdkafka's native ones
  included, sampled while it publishes), and a read_committed read of every topic
  checks that each event arrived exactly once.
* **Single-part throughput against the code before.** With ``OUTBOX_BENCH_BASELINE_CODE``
  naming a checkout of the code before (e.g. a worktree of main), one subscriber of one
  part publishes the same backlog with that checkout's relay and with this one's,
  interleaved (bench/method.py), each clocked from the resume of its paused subscriber.
  Without it, the figure is left out.

The 100-busy-parts figures (aggregate throughput against one subscriber, peak RSS) are
``fanout``'s.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

from bench.harness import (
    BASELINE_CODE,
    BATCH,
    REPO,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    _status_kib,
    create_topics,
    fill_outbox,
    final_positions,
    free_port,
    fresh_subscribers,
    paused_drain,
    set_all_paused,
    wait_all_paused,
    wait_published,
)
from bench.method import Samples, interleave, settle
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.core.subscribers import Subscriber, ValueFormat

MANY = 1000
EVENTS_PER_TYPE = {"quick": 10, "default": 50, "full": 100}


def run(stack: Stack, scale: Scale) -> list[Figure]:
    figures = many_subscribers(stack, scale)
    baseline = os.environ.get(BASELINE_CODE)
    if baseline:
        figures.append(single_part(stack, scale, Path(baseline)))
    return figures


def many_subscribers(stack: Stack, scale: Scale) -> list[Figure]:
    events = MANY * EVENTS_PER_TYPE.get(scale.name, 50)
    url = stack.database("bounded")
    fill_outbox(url, events, types=MANY)
    prefix = stack.topic_prefix("bounded")
    topics = [f"{prefix}.s{i}" for i in range(MANY)]
    fresh_subscribers(
        url,
        [Subscriber(f"s{i}", topic=topics[i], value_format=ValueFormat.JSON,
                    aggregate_types=frozenset({f"order{i}"})) for i in range(MANY)],
    )  # fmt: skip
    create_topics(stack.bootstrap, topics, 1)
    settle(url)
    targets = final_positions(url)
    set_all_paused(url, paused=True)
    port = free_port()
    threads: list[int] = []
    with RelayProcesses(stack, url, "bounded", poll_interval=1.0, metrics_enabled=True,
                        metrics_port=port) as relays:  # fmt: skip
        started = time.perf_counter()
        wait_all_paused(port, MANY, relays.check_alive)
        startup = time.perf_counter() - started
        idle_threads = _status_kib(relays.procs[0].pid, "Threads")
        idle_rss = relays.rss_mb()[0]

        def tick() -> None:
            relays.check_alive()
            threads.append(_status_kib(relays.procs[0].pid, "Threads"))

        resumed = time.perf_counter()
        set_all_paused(url, paused=False)
        _, done = wait_published(url, targets, tick=tick)
        peak = relays.peak_rss_mb()[0]
    seen = Counter(
        r.message_id
        for r in KafkaTopicReader({"bootstrap.servers": stack.bootstrap}, timeout=600).read(topics)
    )
    exactly_once = len(seen) == events and max(seen.values()) == 1
    details = {
        "subscribers": MANY,
        "events": events,
        "distinct_published": len(seen),
        "most_copies": max(seen.values()) if seen else 0,
        "exactly_once": exactly_once,
        "publish_seconds": done - resumed,
        "idle_threads": idle_threads,
        "idle_rss_mb": idle_rss,
        "max_producers": 8,
    }
    one = Samples((1.0,))
    return [
        Figure.of("bounded", f"start-up s, {MANY} filtered subscribers (start to every part "
                  "ready)", Samples((startup,)), "s", details=details),
        Figure.of("bounded", f"peak RSS MiB, {MANY} filtered subscribers publishing",
                  Samples((peak,)), "MiB", target="value<=300", details=details),
        Figure.of("bounded", f"most threads, {MANY} filtered subscribers publishing",
                  Samples((float(max(threads, default=idle_threads)),)), "threads",
                  target="value<=127", details=details),
        Figure.of("bounded", f"exactly once, {MANY} filtered subscribers (1 = yes)",
                  Samples((1.0 if exactly_once else 0.0,)), "", one, "every event once",
                  "ratio>=1", details),
    ]  # fmt: skip


def single_part(stack: Stack, scale: Scale, baseline: Path) -> Figure:
    """One part's backlog, this checkout's relay against ``baseline``'s, interleaved."""
    events = scale.throughput_events
    url = stack.database("single")
    fill_outbox(url, events)
    sides = {"this": REPO, "before": baseline}
    drains: dict[str, list[float]] = {name: [] for name in sides}

    def side(name: str) -> float:
        fresh_subscribers(url, [Subscriber("s", topic=stack.topic_prefix(f"single-{name}"))])
        drain = paused_drain(stack, url, f"single-{name}", 1, code=sides[name], batch_size=BATCH)
        drains[name].append(drain.seconds)
        return events / drain.seconds

    def before_each() -> None:
        stack.fresh_broker()
        settle(url)

    rates = interleave({name: (lambda n=name: side(n)) for name in sides}, scale.repetitions,
                       before_each=before_each)  # fmt: skip
    return Figure.of("bounded", "single-part ev/s, this relay vs the code before",
                     rates["this"], "ev/s", rates["before"], f"relay of {baseline}",
                     "ratio>=1.0", {"events": events, "seconds": drains})  # fmt: skip
