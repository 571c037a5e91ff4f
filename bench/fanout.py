"""Cost growth with subscribers: 1 subscriber against 100, one relay process.

Every subscriber reads the whole outbox on its own checkpoint and publishes to its own
topic, so 100 subscribers do 100 times the work. The figure is the aggregate rate
(events published per second, summed over subscribers): at 1.0x, adding subscribers
costs nothing beyond their own events. The process's peak memory is in the details:
each subscriber part has its own connection, producer and thread.
"""

from __future__ import annotations

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
from relay.subscribers import Subscriber

MANY = 100


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.fanout_events
    # The single subscriber drains as many events as the hundred publish in all, so
    # both clocks run long enough to mean something.
    one, one_mb = aggregate_rate(stack, events * MANY // 10, 1)
    stack.fresh_broker()
    many, many_mb = aggregate_rate(stack, events, MANY)
    return [
        Figure("fanout", f"aggregate ev/s, {MANY} vs 1 subscriber", many, "ev/s", one,
               "1 subscriber", None,
               {"events": events, "peak_rss_mb_1": one_mb, f"peak_rss_mb_{MANY}": many_mb}),
    ]  # fmt: skip


def aggregate_rate(stack: Stack, events: int, subscribers: int) -> tuple[float, float]:
    url = stack.database(f"fanout{subscribers}")
    fill_outbox(url, events)
    prefix = stack.topic_prefix(f"fanout{subscribers}")
    add_subscribers(url, [Subscriber(f"s{i}", topic=f"{prefix}.s{i}") for i in range(subscribers)])
    targets = final_positions(url)
    with RelayProcesses(stack, url, f"fanout{subscribers}", batch_size=BATCH) as relays:
        first, done = wait_published(url, targets, tick=relays.check_alive)
        peak = max(relays.peak_rss_mb())
    # The clock starts at the first checkpoint: one batch of one subscriber is not in it.
    return (subscribers * events - BATCH) / (done - first), peak
