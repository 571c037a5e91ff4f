"""Cost growth with subscribers: 1 subscriber against 100 filtered ones, one relay process.

The outbox holds 100 aggregate types in turn; each of the 100 subscribers takes one of
them (``aggregate_types``) to its own topic, so together they publish every event once,
as the single unfiltered subscriber does. The figure is the aggregate rate (events
published per second, summed over subscribers) against the single subscriber's: at
1.0x, splitting a stream over filtered subscribers costs nothing.

Both runs publish the same rows and are clocked the same way: their subscribers start
paused, and the clock runs from the resume of all of them (every part started, its
producer fenced, its Kafka-side checkpoint read) to the last part's last checkpoint.
Each subscriber of the hundred publishes at least 10 batches: the batch size of both runs
is a tenth of one subscriber's share (at most the relay's default), so the figure is
publishing, not one transaction's fixed cost per subscriber. The runs alternate, each on
an empty broker after a CHECKPOINT (bench/method.py). Start-up, which a relay pays once,
and the peak memory of the process are figures of their own, 100 parts beside 1.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.harness import (
    BATCH,
    Drain,
    Figure,
    Scale,
    Stack,
    create_topics,
    fill_outbox,
    fresh_subscribers,
    paused_drain,
)
from bench.method import Samples, interleave, settle
from relay.subscribers import Subscriber

MANY = 100
MIN_BATCHES = 10  # per subscriber of the hundred


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.fanout_events
    batch = min(BATCH, max(1, events // MANY // MIN_BATCHES))
    url = stack.database("fanout")
    fill_outbox(url, events, types=MANY)
    settle(url)
    drains: dict[int, list[Drain]] = {1: [], MANY: []}

    def side(subscribers: int) -> Callable[[], float]:
        def measure() -> float:
            drains[subscribers].append(publish(stack, url, subscribers, batch))
            return events / drains[subscribers][-1].seconds

        return measure

    def before_each() -> None:
        stack.fresh_broker()  # a hundred topics a run would weigh on the next runs
        settle(url)

    rates = interleave({"1": side(1), "many": side(MANY)}, scale.repetitions,
                       before_each=before_each)  # fmt: skip

    def of(subscribers: int, what: Callable[[Drain], float]) -> Samples:
        return Samples(tuple(what(d) for d in drains[subscribers]))

    details = {
        "events": events,
        "events_per_subscriber": events // MANY,
        "batch_size": batch,
        "batches_per_subscriber": events // MANY / batch,
        "cpu_1": [d.cpu for d in drains[1]],
        f"cpu_{MANY}": [d.cpu for d in drains[MANY]],
    }
    return [
        Figure.of("fanout", f"aggregate ev/s, {MANY} filtered vs 1 subscriber", rates["many"],
                  "ev/s", rates["1"], "1 subscriber", "ratio>=0.8", details),
        Figure.of("fanout", f"start-up s, {MANY} subscribers vs 1 (relay start to every part "
                  "ready)", of(MANY, lambda d: d.startup), "s", of(1, lambda d: d.startup),
                  "1 subscriber", None, details),
        Figure.of("fanout", f"peak RSS MiB, {MANY} parts vs 1", of(MANY, lambda d: d.peak_rss_mb),
                  "MiB", of(1, lambda d: d.peak_rss_mb), "1 part", None, details),
    ]  # fmt: skip


def publish(stack: Stack, url: str, subscribers: int, batch: int) -> Drain:
    """One run of ``subscribers`` new subscribers over the whole backlog."""
    prefix = stack.topic_prefix(f"fanout{subscribers}")
    filters = [frozenset({f"order{i}"}) for i in range(subscribers)] if subscribers > 1 else [None]
    fresh_subscribers(
        url,
        [Subscriber(f"s{i}", topic=f"{prefix}.s{i}", aggregate_types=types)
         for i, types in enumerate(filters)],
    )  # fmt: skip
    # Created up front, as in production (deploy/README.md): creating 100 topics of 3
    # partitions is the broker's work, not publishing.
    create_topics(stack.bootstrap, [f"{prefix}.s{i}" for i in range(subscribers)], 3)
    return paused_drain(stack, url, f"fanout{subscribers}", subscribers, batch_size=batch)
