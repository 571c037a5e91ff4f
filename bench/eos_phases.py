"""Where the exactly-once transaction's time goes (#31), at ``scale.latency_rate``.

``./dev.sh bench --scale quick --only eos_phases`` (on request, not in the default set).

The run is bench/latency.py's relay run, unchanged: a writer process commits one event
per transaction through the write API, an in-process relay with production defaults
publishes them in Kafka transactions, a read_committed consumer process notes when each
arrives. Here the relay is also traced from outside: for the run, this module wraps a
few of its methods (the part worker's fetch, encode and checkpoint, the transactional
publisher's produce and calls, the probe's wake-up) with a clock, and restores them
after. Nothing in the product changes; a wrapper costs a microsecond or two a call,
against milliseconds per cycle (``plain`` runs the same benchmark untraced,
interleaved, to show it).

Two views come out of one run:

* **Per event** (commit, wake, fetch, Kafka commit, arrival are stamped per message id,
  all on CLOCK_MONOTONIC): how its latency splits into the wait before the fetch that
  read it (``commit_to_wake``: the probe noticing; ``wake_to_fetched``: the part's turn
  and the query, or the cycle in flight), the relay's cycle after it
  (``fetched_to_committed``: encode, produce, send offsets, commit), and the broker and
  consumer after the commit (``committed_to_visible``: markers, the consumer's fetch).
  Medians per run.
* **Per transaction**: each phase of the part's thread (median ms per call, and its
  share of the run's wall time): the fetch that starts a cycle, the read-ahead fetch
  and encode inside the open transaction, ``begin_transaction``, ``produce``,
  ``send_offsets_to_transaction``, ``commit_transaction`` and the Postgres checkpoint
  (``advance``). Empty fetches (woken, but nothing decided yet: the xmin horizon) are
  counted apart.
"""

from __future__ import annotations

import bisect
import functools
import json
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.harness import Figure, Scale, Stack
from bench.latency import WARMUP_S, relay_latency, relay_run, samples_of
from bench.method import Samples as Repeated
from bench.method import interleave
from relay.adapters.kafka.kafka import TransactionalPublisher, _BatchProducer
from relay.engine.batch_publisher import BatchPublisher, PartReader
from relay.engine.worker import PartWorker
from relay.observability.tracing import TracingHook

# The phases of the part's thread, in cycle order (names of the spans recorded).
PHASES = (
    "fetch",  # the fetch that starts a cycle (not empty)
    "fetch_empty",  # a fetch that found nothing decided
    "encode",  # the first batch's encoding (the slow path, with the poison policy)
    "begin_transaction",
    "produce",
    "readahead_fetch",  # in the open transaction: the next rows, which may join
    "readahead_encode",
    "send_offsets_to_transaction",
    "commit_transaction",  # flushes the records, then EndTxn
    "advance",  # the Postgres checkpoint (compare-and-set)
)
EVENT_PARTS = ("commit_to_wake", "wake_to_fetched", "fetched_to_committed", "committed_to_visible")


class Trace:
    """What the wrapped methods saw: spans per phase, and stamps per message id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[float]] = defaultdict(list)  # phase -> durations (s)
        self.wakes: list[float] = []
        self.fetched: dict[str, float] = {}
        self.committed: dict[str, float] = {}
        self.local = threading.local()  # inside the read-ahead?
        # librdkafka's statistics, the last of each producer: requests sent, by type.
        self.requests: dict[str, Counter[str]] = {}

    def statistics(self, report: str) -> None:
        stats = json.loads(report)
        sent: Counter[str] = Counter()
        for broker in stats.get("brokers", {}).values():
            sent.update({kind: n for kind, n in broker.get("req", {}).items() if n})
        with self.lock:
            self.requests[stats["name"]] = sent

    def requests_per_transaction(self) -> dict[str, float]:
        """Each transactional request type, per committed transaction (EndTxn): above
        1 for AddPartitionsToTxn, the retries librdkafka made (CONCURRENT_TRANSACTIONS
        while the last transaction's markers are written gets a fixed 20 ms wait)."""
        with self.lock:
            total = sum(self.requests.values(), Counter())
        ends = total.get("EndTxn", 0)
        kinds = ("AddPartitionsToTxn", "AddOffsetsToTxn", "TxnOffsetCommit", "Produce")
        return {kind: round(total.get(kind, 0) / ends, 3) for kind in kinds} if ends else {}

    def span(self, phase: str, began: float) -> None:
        with self.lock:
            self.spans[phase].append(time.monotonic() - began)


@contextmanager
def traced() -> Iterator[Trace]:
    """Wrap the relay's methods with the trace's clock while the block runs."""
    trace = Trace()
    originals: list[tuple[type, str, Any]] = []

    def patch(cls: type, name: str, make: Callable[[Any], Any]) -> None:
        original = cls.__dict__[name]
        originals.append((cls, name, original))
        setattr(cls, name, functools.wraps(original)(make(original)))

    patch(PartWorker, "wake", lambda f: _wake(trace, f))
    patch(PartReader, "fetch", lambda f: _fetch(trace, f))
    patch(BatchPublisher, "prepare", lambda f: _prepare(trace, f))
    patch(BatchPublisher, "_encode", lambda f: _timed(trace, "encode", f))
    patch(BatchPublisher, "advance", lambda f: _timed(trace, "advance", f))
    patch(_BatchProducer, "_produce_all", lambda f: _timed(trace, "produce", f))
    patch(TransactionalPublisher, "_call", lambda f: _call(trace, f))
    patch(TracingHook, "published", lambda f: _published(trace, f))
    patch(_BatchProducer, "_new_producer", lambda f: _with_statistics(trace, f))
    try:
        yield trace
    finally:
        for cls, name, original in reversed(originals):
            setattr(cls, name, original)


def _timed(trace: Trace, phase: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        try:
            return f(*args, **kwargs)
        finally:
            trace.span(phase, began)

    return wrapper


def _wake(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any) -> Any:
        with trace.lock:
            trace.wakes.append(time.monotonic())
        return f(self)

    return wrapper


def _fetch(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, store: Any, state: Any) -> Any:
        began = time.monotonic()
        batch = f(self, store, state)
        ahead = getattr(trace.local, "ahead", False)
        phase = "readahead_fetch" if ahead else "fetch" if batch.events else "fetch_empty"
        trace.span(phase, began)
        now = time.monotonic()
        with trace.lock:
            for event in batch.events:
                trace.fetched.setdefault(str(event.message_id), now)
        return batch

    return wrapper


def _prepare(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    """The read-ahead: its fetch is timed by ``_fetch``; the rest is encoding."""

    def wrapper(self: Any, store: Any, state: Any, **kwargs: Any) -> Any:
        trace.local.ahead = True
        began = time.monotonic()
        try:
            return f(self, store, state, **kwargs)  # read=: what a cut left
        finally:
            trace.local.ahead = False
            took = time.monotonic() - began
            with trace.lock:
                fetch = trace.spans["readahead_fetch"][-1] if trace.spans["readahead_fetch"] else 0
                trace.spans["readahead_encode"].append(max(0.0, took - fetch))

    return wrapper


def _call(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, operation: Callable[..., Any], *args: Any) -> Any:
        began = time.monotonic()
        try:
            return f(self, operation, *args)
        finally:
            trace.span(getattr(operation, "__name__", "call"), began)

    return wrapper


def _with_statistics(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    """A producer that reports its statistics (served by the flush each commit does)."""

    def wrapper(self: Any) -> Any:
        self._config = {
            **self._config,
            "statistics.interval.ms": 500,
            "stats_cb": trace.statistics,
        }
        return f(self)

    return wrapper


def _published(trace: Trace, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, events: Any, *args: Any) -> Any:
        now = time.monotonic()
        with trace.lock:
            for event in events:
                trace.committed.setdefault(str(event.message_id), now)
        return f(self, events, *args)

    return wrapper


# -- one run ---------------------------------------------------------------------------


def traced_run(stack: Stack, scale: Scale) -> dict[str, Any]:
    """One exactly-once latency run with the trace on: per-event medians (ms), phase
    medians (ms) and shares of the window, events per transaction."""
    with traced() as trace:
        stamps, arrivals, totals = relay_run(stack, scale)
    samples = samples_of(stamps, arrivals, scale, totals["published"] / max(1, totals["batches"]))
    measured = stamps[round(scale.latency_rate * WARMUP_S) :]
    parts = _event_parts(trace, measured, arrivals)
    window = samples.window_s or 1.0
    phases = {
        phase: {
            "calls": len(trace.spans[phase]),
            "median_ms": round(statistics.median(trace.spans[phase]) * 1000, 3)
            if trace.spans[phase]
            else 0.0,
            "p90_ms": round(_quantile(trace.spans[phase], 0.9) * 1000, 3),
            # Of the whole run (warm-up included), as a share of the measured window's
            # length scaled to the run: where the part's thread spends its time.
            "share": round(sum(trace.spans[phase]) / (window * _run_scale(scale)), 4),
        }
        for phase in PHASES
    }
    return {
        "p50_ms": samples.ms(0.5),
        "p99_ms": samples.ms(0.99),
        "events_per_transaction": round(samples.per_transaction, 2),
        "events": {k: round(statistics.median(v) * 1000, 3) for k, v in parts.items() if v},
        "events_p90": {k: round(_quantile(v, 0.9) * 1000, 3) for k, v in parts.items() if v},
        "phases": phases,
        "requests_per_transaction": trace.requests_per_transaction(),
        "missing": samples.missing,
    }


def _run_scale(scale: Scale) -> float:
    """The run's length over the measured window's (the spans cover the warm-up too)."""
    return (WARMUP_S + scale.latency_seconds) / scale.latency_seconds


def _event_parts(
    trace: Trace, measured: list[tuple[str, float]], arrivals: dict[str, float]
) -> dict[str, list[float]]:
    parts: dict[str, list[float]] = {name: [] for name in EVENT_PARTS}
    wakes = sorted(trace.wakes)
    for key, committed_at in measured:
        fetched, done, seen = trace.fetched.get(key), trace.committed.get(key), arrivals.get(key)
        if fetched is None or done is None or seen is None:
            continue
        wake = _first_after(wakes, committed_at)
        if wake is not None and wake <= fetched:
            parts["commit_to_wake"].append(wake - committed_at)
            parts["wake_to_fetched"].append(fetched - wake)
        parts["fetched_to_committed"].append(done - fetched)
        parts["committed_to_visible"].append(seen - done)
    return parts


def _first_after(times: list[float], at: float) -> float | None:
    i = bisect.bisect_left(times, at)
    return times[i] if i < len(times) else None


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the benchmark ---------------------------------------------------------------------


def run(stack: Stack, scale: Scale) -> list[Figure]:
    runs: list[dict[str, Any]] = []
    plain: list[float] = []

    def traced_side() -> float:
        runs.append(traced_run(stack, scale))
        return float(runs[-1]["p50_ms"])

    def plain_side() -> float:
        plain.append(relay_latency(stack, scale).ms(0.5))
        return plain[-1]

    interleave({"traced": traced_side, "plain": plain_side}, scale.repetitions)
    figures = [
        Figure.of("eos_phases", "exactly-once p50, traced (untraced as baseline)",
                  Repeated(tuple(r["p50_ms"] for r in runs)), "ms", Repeated(tuple(plain)),
                  "the same run untraced", details={"runs": runs}),
    ]  # fmt: skip
    for part in EVENT_PARTS:
        values = tuple(r["events"].get(part, 0.0) for r in runs)
        figures.append(Figure.of("eos_phases", f"per event median: {part}", Repeated(values), "ms"))
    for phase in PHASES:
        median = tuple(r["phases"][phase]["median_ms"] for r in runs)
        share = tuple(r["phases"][phase]["share"] * 100 for r in runs)
        calls = [r["phases"][phase]["calls"] for r in runs]
        figures.append(Figure.of("eos_phases", f"phase {phase}: median per call",
                                 Repeated(median), "ms", details={"calls": calls}))  # fmt: skip
        figures.append(Figure.of("eos_phases", f"phase {phase}: share of the run",
                                 Repeated(share), "%"))  # fmt: skip
    adds = tuple(r["requests_per_transaction"].get("AddPartitionsToTxn", 0.0) for r in runs)
    figures.append(Figure.of("eos_phases", "AddPartitionsToTxn requests per transaction",
                             Repeated(adds), "req", details={
                                 "per_transaction": [r["requests_per_transaction"] for r in runs]
                             }))  # fmt: skip
    return figures
