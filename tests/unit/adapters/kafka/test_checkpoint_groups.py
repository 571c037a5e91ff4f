"""How many checkpoint reads hold a consumer at once (relay/adapters/kafka/
checkpoint_groups.py), over reads that record their overlap instead of reaching Kafka."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from relay.adapters.kafka import checkpoint_groups
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups


class Reads:
    """Stands in for the consumer's read: counts the reads in progress at once, and
    holds each until ``release`` is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, group: str, wanted: list[Any], timeout_s: float) -> list[Any]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        self.started.release()
        try:
            self.release.wait(30)
            return []
        finally:
            with self.lock:
                self.now -= 1


def read_in_threads(groups: CheckpointGroups, count: int) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=groups.committed, args=(f"g.{i}", "c", 5.0)) for i in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads


def two_held_then_a_third(
    monkeypatch: pytest.MonkeyPatch, wait_s: float
) -> tuple[Reads, list[threading.Thread]]:
    """Two reads in progress, held, then a third asked for, a slot waited for up to
    ``wait_s``; the reads, and the threads of all three."""
    monkeypatch.setattr(checkpoint_groups, "_READER_WAIT_S", wait_s)
    reads = Reads()
    groups = CheckpointGroups({})
    monkeypatch.setattr(groups, "_read", reads)
    held = read_in_threads(groups, 2)
    for _ in held:
        reads.started.acquire()
    return reads, held + read_in_threads(groups, 1)


def test_at_most_two_reads_hold_a_consumer_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight parts starting together each opened a consumer of 4 threads at once (#53).
    reads, threads = two_held_then_a_third(monkeypatch, 60.0)  # never given way here
    assert not reads.started.acquire(timeout=0.5), "a third read began beside two"
    reads.release.set()
    for thread in threads:
        thread.join(10)
    assert reads.most == 2 and not any(t.is_alive() for t in threads)


def test_reads_that_hang_make_no_other_part_wait_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read can take its whole timeout (a group the broker refuses); the others wait
    ``_READER_WAIT_S`` for a slot, then read anyway: the bound gives way rather than
    stall a part."""
    reads, threads = two_held_then_a_third(monkeypatch, 0.2)
    assert reads.started.acquire(timeout=20), "the third read waited for the hung ones"
    assert reads.most == 3
    reads.release.set()
    for thread in threads:
        thread.join(10)
