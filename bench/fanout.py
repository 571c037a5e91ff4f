"""Cost growth with subscribers: 1 subscriber against 100 filtered ones, one relay process.

The outbox holds 100 aggregate types in turn; each of the 100 subscribers takes one of
them (``aggregate_types``) to its own topic, so together they publish every event once,
as the single unfiltered subscriber does. The figure is the aggregate rate (events
published per second, summed over subscribers) against the single subscriber's: at
1.0x, splitting a stream over filtered subscribers costs nothing. Each subscriber reads
past the rows its filter drops, so that reading is the cost of fan-out. The process's
peak memory is in the details: each subscriber part has its own connection, producer
and thread.
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
    one, one_mb = aggregate_rate(stack, events, 1)
    stack.fresh_broker()
    many, many_mb = aggregate_rate(stack, events, MANY)
    return [
        Figure("fanout", f"aggregate ev/s, {MANY} filtered vs 1 subscriber", many, "ev/s", one,
               "1 subscriber", "ratio>=0.8",
               {"events": events, "peak_rss_mb_1": one_mb, f"peak_rss_mb_{MANY}": many_mb}),
    ]  # fmt: skip


def aggregate_rate(stack: Stack, events: int, subscribers: int) -> tuple[float, float]:
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
    with RelayProcesses(stack, url, f"fanout{subscribers}", batch_size=BATCH) as relays:
        first, done = wait_published(url, targets, tick=relays.check_alive)
        peak = max(relays.peak_rss_mb())
    # The clock starts at the first checkpoint: one batch of one subscriber is not in it.
    return (events - BATCH // subscribers) / (done - first), peak
