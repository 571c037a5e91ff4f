"""Cost growth with subscribers: 1 subscriber against 100 filtered ones, one relay process.

The outbox holds 100 aggregate types in turn; each of the 100 subscribers takes one of
them (``aggregate_types``) to its own topic, so together they publish every event once,
as the single unfiltered subscriber does. The figure is the aggregate rate (events
published per second, summed over subscribers) against the single subscriber's: at
1.0x, splitting a stream over filtered subscribers costs nothing.

Both runs publish the same rows and are clocked the same way: their subscribers start
paused, and the clock runs from the resume of all of them (every part started and
paused) to the last part's last checkpoint. A part borrows a producer from the relay's
pool only when it has rows to publish, so fencing and recovery fall inside the window
(the code before issue #30 did them before the resume, a producer per part).
Each subscriber of the hundred publishes at least 10 batches: the batch size of both runs
is a tenth of one subscriber's share (at most the relay's default), so the figure is
publishing, not one transaction's fixed cost per subscriber. The runs alternate, each on
an empty broker after a CHECKPOINT (bench/method.py). Start-up, which a relay pays once,
the peak memory of the process (target: under 300 MiB with 100 busy parts, issue #30)
and the most threads it ran while publishing are figures of their own, 100 parts
beside 1.

With ``OUTBOX_BENCH_BASELINE_CODE`` naming a checkout of the code before (bench/bounded.py),
the hundred subscribers also run on that checkout's relay, as a third side of each
round: its rate, peak RSS and threads are the "before" of the same run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from bench.harness import (
    BASELINE_CODE,
    BATCH,
    REPO,
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
from relay.core.subscribers import Subscriber

MANY = 100
MIN_BATCHES = 10  # per subscriber of the hundred
RSS_TARGET_MIB = 300  # issue #30: a relay of 100 busy parts


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.fanout_events
    batch = min(BATCH, max(1, events // MANY // MIN_BATCHES))
    url = stack.database("fanout")
    fill_outbox(url, events, types=MANY)
    settle(url)
    baseline = os.environ.get(BASELINE_CODE)
    # side -> (subscribers, the checkout whose relay runs)
    sides = {"1": (1, REPO), "many": (MANY, REPO)}
    if baseline:
        sides["many before"] = (MANY, Path(baseline))
    drains: dict[str, list[Drain]] = {name: [] for name in sides}

    def side(name: str) -> Callable[[], float]:
        subscribers, code = sides[name]

        def measure() -> float:
            drains[name].append(publish(stack, url, subscribers, batch, code))
            return events / drains[name][-1].seconds

        return measure

    def before_each() -> None:
        stack.fresh_broker()  # a hundred topics a run would weigh on the next runs
        settle(url)

    rates = interleave({name: side(name) for name in sides}, scale.repetitions,
                       before_each=before_each)  # fmt: skip

    def of(name: str, what: Callable[[Drain], float]) -> Samples:
        return Samples(tuple(what(d) for d in drains[name]))

    details = {
        "events": events,
        "events_per_subscriber": events // MANY,
        "batch_size": batch,
        "batches_per_subscriber": events // MANY / batch,
        **{f"cpu_{name}": [d.cpu for d in drains[name]] for name in sides},
        **{f"threads_{name}": [d.threads for d in drains[name]] for name in sides},
        **{
            f"producers_opened_{name}": [d.producers_opened for d in drains[name]] for name in sides
        },
        "baseline_code": baseline,
    }
    rss = f"value<={RSS_TARGET_MIB}"
    figures = [
        Figure.of("fanout", f"aggregate ev/s, {MANY} filtered vs 1 subscriber", rates["many"],
                  "ev/s", rates["1"], "1 subscriber", "ratio>=0.8", details),
        Figure.of("fanout", f"start-up s, {MANY} subscribers vs 1 (relay start to every part "
                  "ready)", of("many", lambda d: d.startup), "s", of("1", lambda d: d.startup),
                  "1 subscriber", None, details),
        Figure.of("fanout", f"peak RSS MiB, {MANY} parts vs 1", of("many", lambda d: d.peak_rss_mb),
                  "MiB", of("1", lambda d: d.peak_rss_mb), "1 part", rss, details),
        Figure.of("fanout", f"most threads, {MANY} parts vs 1", of("many", lambda d: d.threads),
                  "threads", of("1", lambda d: d.threads), "1 part", None, details),
    ]  # fmt: skip
    if baseline:
        figures += before_and_after(rates, of, baseline, details)
    return figures


def before_and_after(
    rates: dict[str, Samples],
    of: Callable[[str, Callable[[Drain], float]], Samples],
    baseline: str,
    details: dict[str, object],
) -> list[Figure]:
    """The hundred parts on this relay against the same on the code before (#30)."""
    before = f"relay of {baseline}"
    return [
        Figure.of("fanout", f"aggregate ev/s, {MANY} filtered, this relay vs before",
                  rates["many"], "ev/s", rates["many before"], before, None, details),
        Figure.of("fanout", f"peak RSS MiB, {MANY} parts, this relay vs before",
                  of("many", lambda d: d.peak_rss_mb), "MiB",
                  of("many before", lambda d: d.peak_rss_mb), before,
                  f"value<={RSS_TARGET_MIB}", details),
        Figure.of("fanout", f"most threads, {MANY} parts, this relay vs before",
                  of("many", lambda d: d.threads), "threads",
                  of("many before", lambda d: d.threads), before, None, details),
    ]  # fmt: skip


def publish(stack: Stack, url: str, subscribers: int, batch: int, code: Path = REPO) -> Drain:
    """One run of ``subscribers`` new subscribers over the whole backlog, by the relay of
    the checkout ``code``."""
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
    return paused_drain(
        stack, url, f"fanout{subscribers}", subscribers, code=code, batch_size=batch
    )
