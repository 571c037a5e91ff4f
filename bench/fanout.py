"""Cost growth with subscribers: 1 subscriber against 100 (or N) filtered ones, one relay.

The outbox holds 100 aggregate types in turn; each of the 100 subscribers takes one of
them (``aggregate_types``) to its own topic, so together they publish every event once,
as the single unfiltered subscriber does. ``OUTBOX_BENCH_FANOUT_SUBSCRIBERS=1000`` runs
issue #53's 1,000 instead (as many types and subscribers, the same backlog). 100 stays
the default: the figures recorded so far mean 100, and at ``quick`` a thousand would
each publish 100 events in batches of 10, a transaction's fixed cost rather than
publishing (below), while every round created 3,000 partitions and started 1,000 parts.
The figure is the aggregate rate (events published per second, summed over
subscribers) against the single subscriber's: at 1.0x, splitting a stream over
filtered subscribers costs nothing.

Both runs publish the same rows and are clocked the same way: their subscribers start
paused, and the clock runs from the resume of all of them (every part started and
paused) to the last part's last checkpoint. Issue #53 clocks from the first event of any
subscriber to the last of all; that clock is reported too, from the records' own
timestamps (the producer's at ``produce()``, the broker's on a commit marker): the
resume's clock also holds the parts' wake-up, fencing and first fetch before any event
is sent, and the poll of the last checkpoint after the last is. A part borrows a
producer from the relay's pool only when it has rows to publish, so fencing and
recovery fall inside the window (the code before issue #30 did them before the resume,
a producer per part).
Each subscriber of the hundred publishes at least 10 batches: the batch size of both runs
is a tenth of one subscriber's share (at most the relay's default), so the figure is
publishing, not one transaction's fixed cost per subscriber. The runs alternate, each on
an empty broker after a CHECKPOINT (bench/method.py). Start-up, which a relay pays once,
the peak memory of the process (target: under 300 MiB with 100 busy parts, issue #30)
and the most threads it ran while publishing are figures of their own, 100 parts
beside 1.

The same transactions made by plain clients, with no relay around them
(bench/fanout_floor.py), are two more sides of each round: their N-against-1 ratio is the
broker's own, and the relay's ratio over theirs says what of the relay's shortfall is the
relay's (#53).

With ``OUTBOX_BENCH_BASELINE_CODE`` naming a checkout of the code before (bench/bounded.py),
the hundred subscribers also run on that checkout's relay, as a third side of each
round: its rate, peak RSS and threads are the "before" of the same run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from bench.fanout_floor import plain_publish
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

DEFAULT_MANY = 100
# The number of filtered subscribers (issue #53's target: 1,000); 100 when unset.
SUBSCRIBERS = "OUTBOX_BENCH_FANOUT_SUBSCRIBERS"
MIN_BATCHES = 10  # per filtered subscriber
RSS_TARGET_MIB = 300  # issue #30: a relay of 100 busy parts; #53: of 1,000
THREADS_TARGET = 128  # issue #53: 1,000 subscribers within 128 threads
PARTITIONS = 3  # of each subscriber's topic


def run(stack: Stack, scale: Scale) -> list[Figure]:
    many = subscriber_count(os.environ)
    events = scale.fanout_events
    batch = min(BATCH, max(1, events // many // MIN_BATCHES))
    url = stack.database("fanout")
    fill_outbox(url, events, types=many)
    settle(url)
    baseline = os.environ.get(BASELINE_CODE)
    # side -> (subscribers, the checkout whose relay runs)
    sides = {"1": (1, REPO), "many": (many, REPO)}
    if baseline:
        sides["many before"] = (many, Path(baseline))
    drains: dict[str, list[Drain]] = {name: [] for name in sides}
    spans: dict[str, list[float]] = {name: [] for name in sides}

    def side(name: str) -> Callable[[], float]:
        subscribers, code = sides[name]

        def measure() -> float:
            drain, span = publish(stack, url, subscribers, batch, code)
            drains[name].append(drain)
            spans[name].append(span)
            return events / drain.seconds

        return measure

    def before_each() -> None:
        stack.fresh_broker()  # a hundred topics a run would weigh on the next runs
        settle(url)

    floors = {"plain 1": 1, "plain many": many}

    def plain(name: str) -> Callable[[], float]:
        def measure() -> float:
            span = plain_publish(stack, floors[name], events, batch, first_to_last_seconds)
            spans[name].append(span)
            return events / span

        return measure

    spans.update({name: [] for name in floors})
    plan = {**{name: side(name) for name in sides}, **{name: plain(name) for name in floors}}
    rates = interleave(plan, scale.repetitions, before_each=before_each)

    def of(name: str, what: Callable[[Drain], float]) -> Samples:
        return Samples(tuple(what(d) for d in drains[name]))

    def first_to_last(name: str) -> Samples:
        return Samples(tuple(events / span for span in spans[name]))

    details: dict[str, object] = {
        "subscribers": many,
        "events": events,
        "events_per_subscriber": events // many,
        "batch_size": batch,
        "batches_per_subscriber": events // many / batch,
        **{f"seconds_{name}": [d.seconds for d in drains[name]] for name in sides},
        **{f"first_to_last_seconds_{name}": spans[name] for name in spans},
        **{f"cpu_{name}": [d.cpu for d in drains[name]] for name in sides},
        **{f"threads_{name}": [d.threads for d in drains[name]] for name in sides},
        **{
            f"producers_opened_{name}": [d.producers_opened for d in drains[name]] for name in sides
        },
        "baseline_code": baseline,
    }
    rss = f"value<={RSS_TARGET_MIB}"
    figures = [
        Figure.of("fanout", f"aggregate ev/s, {many} filtered vs 1 subscriber", rates["many"],
                  "ev/s", rates["1"], "1 subscriber", "ratio>=0.8", details),
        Figure.of("fanout", f"aggregate ev/s, {many} filtered vs 1, first event to last",
                  first_to_last("many"), "ev/s", first_to_last("1"), "1 subscriber",
                  "ratio>=0.8", details),
        Figure.of("fanout", f"start-up s, {many} subscribers vs 1 (relay start to every part "
                  "ready)", of("many", lambda d: d.startup), "s", of("1", lambda d: d.startup),
                  "1 subscriber", None, details),
        Figure.of("fanout", f"peak RSS MiB, {many} parts vs 1", of("many", lambda d: d.peak_rss_mb),
                  "MiB", of("1", lambda d: d.peak_rss_mb), "1 part", rss, details),
        Figure.of("fanout", f"most threads, {many} parts vs 1", of("many", lambda d: d.threads),
                  "threads", of("1", lambda d: d.threads), "1 part",
                  f"value<={THREADS_TARGET}", details),
    ]  # fmt: skip
    figures += floor_figures(many, rates, first_to_last, details)
    if baseline:
        figures += before_and_after(many, rates, of, baseline, details)
    return figures


def floor_figures(
    many: int,
    rates: dict[str, Samples],
    first_to_last: Callable[[str], Samples],
    details: dict[str, object],
) -> list[Figure]:
    """The plain clients' N-against-1 ratio, and the relay's over theirs, round by round."""
    relay, floor = first_to_last("many").values, first_to_last("1").values
    relay_ratios = Samples(tuple(m / o for m, o in zip(relay, floor, strict=True)))
    plain_ratios = Samples(
        tuple(m / o for m, o in zip(rates["plain many"].values, rates["plain 1"].values,
                                    strict=True))
    )  # fmt: skip
    return [
        Figure.of("fanout", f"plain clients ev/s, {many} vs 1, first event to last (the "
                  "relay's transactions, no relay)", rates["plain many"], "ev/s",
                  rates["plain 1"], "1 plain client", None, details),
        Figure.of("fanout", f"the relay's {many}-vs-1 ratio over the plain clients'",
                  relay_ratios, "x", plain_ratios, "the plain clients' ratio", None, details),
    ]  # fmt: skip


def subscriber_count(environ: Mapping[str, str]) -> int:
    """The filtered subscribers a run has: ``OUTBOX_BENCH_FANOUT_SUBSCRIBERS``, else 100."""
    text = environ.get(SUBSCRIBERS) or str(DEFAULT_MANY)
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"{SUBSCRIBERS}={text!r}: not a whole number") from None
    if count < 2:  # one subscriber is the baseline's, unfiltered
        raise ValueError(f"{SUBSCRIBERS}={count}: the fan-out needs at least 2 subscribers")
    return count


def before_and_after(
    many: int,
    rates: dict[str, Samples],
    of: Callable[[str, Callable[[Drain], float]], Samples],
    baseline: str,
    details: dict[str, object],
) -> list[Figure]:
    """The filtered subscribers on this relay against the same on the code before (#30)."""
    before = f"relay of {baseline}"
    return [
        Figure.of("fanout", f"aggregate ev/s, {many} filtered, this relay vs before",
                  rates["many"], "ev/s", rates["many before"], before, None, details),
        Figure.of("fanout", f"peak RSS MiB, {many} parts, this relay vs before",
                  of("many", lambda d: d.peak_rss_mb), "MiB",
                  of("many before", lambda d: d.peak_rss_mb), before,
                  f"value<={RSS_TARGET_MIB}", details),
        Figure.of("fanout", f"most threads, {many} parts, this relay vs before",
                  of("many", lambda d: d.threads), "threads",
                  of("many before", lambda d: d.threads), before, None, details),
    ]  # fmt: skip


def publish(
    stack: Stack, url: str, subscribers: int, batch: int, code: Path = REPO
) -> tuple[Drain, float]:
    """One run of ``subscribers`` new subscribers over the whole backlog, by the relay of
    the checkout ``code``; with the seconds from its first record to its last."""
    prefix = stack.topic_prefix(f"fanout{subscribers}")
    filters = [frozenset({f"order{i}"}) for i in range(subscribers)] if subscribers > 1 else [None]
    fresh_subscribers(
        url,
        [Subscriber(f"s{i}", topic=f"{prefix}.s{i}", aggregate_types=types)
         for i, types in enumerate(filters)],
    )  # fmt: skip
    # Created up front, as in production (deploy/README.md): creating 100 topics of 3
    # partitions is the broker's work, not publishing.
    topics = [f"{prefix}.s{i}" for i in range(subscribers)]
    create_topics(stack.bootstrap, topics, PARTITIONS)
    drain = paused_drain(stack, url, f"fanout{subscribers}", subscribers, code=code,
                         batch_size=batch)  # fmt: skip
    return drain, first_to_last_seconds(stack.bootstrap, topics)


def first_to_last_seconds(bootstrap: str, topics: list[str]) -> float:
    """Issue #53's clock: from the earliest record of any of ``topics`` to the latest,
    by the records' timestamps (the first at or after time 0, and the broker's largest:
    the last record's, or its transaction's commit marker's)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]

    def stamps(spec: OffsetSpec) -> list[int]:
        futures = admin.list_offsets({tp: spec for tp in partitions}, request_timeout=60)
        return [future.result().timestamp for future in futures.values()]

    return span_seconds(
        stamps(OffsetSpec.for_timestamp(0)),
        stamps(OffsetSpec.max_timestamp()),  # type: ignore[no-untyped-call]
    )


def span_seconds(firsts: Iterable[int], lasts: Iterable[int]) -> float:
    """Seconds from the earliest of ``firsts`` to the latest of ``lasts`` (partitions'
    timestamps in ms; -1, an empty partition's, is left out)."""
    first = min(ts for ts in firsts if ts >= 0)
    last = max(ts for ts in lasts if ts >= 0)
    return (last - first) / 1000
