"""The exactly-once phase trace's bookkeeping (bench/eos_phases.py): it restores the
methods it wraps, and it splits each event's latency at the right stamps. No figure is
measured here (performance lives in bench/)."""

from __future__ import annotations

import pytest

from bench.eos_phases import Trace, _event_parts, traced
from relay.adapters.kafka.kafka import TransactionalPublisher, _BatchProducer
from relay.engine.batch_publisher import BatchPublisher, PartReader
from relay.engine.worker import PartWorker
from relay.observability.tracing import TracingHook

WRAPPED = [
    (PartWorker, "wake"),
    (PartReader, "fetch"),
    (BatchPublisher, "prepare"),
    (BatchPublisher, "_encode"),
    (BatchPublisher, "advance"),
    (_BatchProducer, "_produce_all"),
    (TransactionalPublisher, "_call"),
    (TracingHook, "published"),
]


def test_the_trace_wraps_the_relay_only_while_it_lasts() -> None:
    before = [cls.__dict__[name] for cls, name in WRAPPED]
    with traced():
        assert all(cls.__dict__[n] is not f for (cls, n), f in zip(WRAPPED, before, strict=True))
    assert [cls.__dict__[name] for cls, name in WRAPPED] == before


def test_the_trace_restores_the_relay_after_a_failure() -> None:
    before = [cls.__dict__[name] for cls, name in WRAPPED]
    with pytest.raises(RuntimeError), traced():
        raise RuntimeError("the run failed")
    assert [cls.__dict__[name] for cls, name in WRAPPED] == before


def test_an_events_latency_splits_at_wake_fetch_commit_and_arrival() -> None:
    trace = Trace()
    trace.wakes = [0.5, 10.2, 30.0]
    trace.fetched = {"a": 10.5, "b": 20.0}
    trace.committed = {"a": 25.0, "b": 25.0}
    # "b" was read ahead inside the open transaction: the wake after its commit came
    # after its fetch, so its wait is not split at a wake; "c" never arrived.
    parts = _event_parts(trace, [("a", 10.0), ("b", 19.0), ("c", 19.5)], {"a": 27.0, "b": 26.0})
    assert parts["commit_to_wake"] == pytest.approx([0.2])
    assert parts["wake_to_fetched"] == pytest.approx([0.3])
    assert parts["fetched_to_committed"] == pytest.approx([14.5, 5.0])
    assert parts["committed_to_visible"] == pytest.approx([2.0, 1.0])
