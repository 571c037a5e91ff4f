"""The latency floor's writer (bench/latency.py): stamped when its message falls due, and
pipelined, so a message due while a commit travels does not wait behind it (#31). No
figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import pytest

import bench.latency
from bench.latency import Plan, _KafkaWriter

WAIT_S = 30.0  # a deadline for the fake's events, never a measurement


class _HeldProducer:
    """A transactional producer whose commits wait until the test releases them."""

    made: ClassVar[list[_HeldProducer]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.produced: list[bytes] = []
        self.committing = threading.Event()
        self.release = threading.Event()
        _HeldProducer.made.append(self)

    def init_transactions(self, timeout: float) -> None:
        pass

    def begin_transaction(self) -> None:
        pass

    def produce(self, topic: str, value: bytes, key: bytes, headers: Any) -> None:
        self.produced.append(dict(headers)["id"])

    def commit_transaction(self, timeout: float) -> None:
        self.committing.set()
        assert self.release.wait(WAIT_S)

    def flush(self, timeout: float) -> None:
        pass


def test_a_message_due_during_a_commit_goes_into_another_transaction_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _HeldProducer.made = []
    monkeypatch.setattr(bench.latency, "Producer", _HeldProducer)
    writer = _KafkaWriter("localhost:9", "floor.order-00")
    plan = Plan(time.monotonic(), 1000, 2, 10**9)
    stamps: list[tuple[str, float]] = []
    try:
        before = time.monotonic()
        writer.write(0, plan, stamps)
        first = _committing(_HeldProducer.made)
        writer.write(1, plan, stamps)  # due while the first commit is held
        second = _committing([p for p in _HeldProducer.made if p is not first])
        assert (first.produced, second.produced) == ([b"b0"], [b"b1"])
        # Stamped as it falls due, not once a producer is free.
        assert [key for key, _ in stamps] == ["b0", "b1"]
        assert all(before <= at <= time.monotonic() for _, at in stamps)
    finally:
        for producer in _HeldProducer.made:
            producer.release.set()
        writer.close()
    assert writer.transactions == 2


def _committing(producers: list[_HeldProducer]) -> _HeldProducer:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for producer in producers:
            if producer.committing.is_set():
                return producer
        time.sleep(0.001)
    raise AssertionError("no producer committed")
