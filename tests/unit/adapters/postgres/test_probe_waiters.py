"""The commit probe looks for news only while a part waits for it (issue #31), over a
fake connection factory and fake parts: no server. A part draining a backlog polls
again by itself, so the probe's queries would only cost CPU."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from relay.adapters.postgres import probe as probe_module
from relay.adapters.postgres.probe import CommitProbe
from tests.support import wait_until


class _Result:
    def __init__(self, row: tuple[Any, ...]) -> None:
        self._row = row

    def fetchone(self) -> tuple[Any, ...]:
        return self._row


class _Connection:
    """Answers the probe's newest-row query with a fixed newest row."""

    def __init__(self, looks: list[int], on_look: Callable[[], None]) -> None:
        self.autocommit = False
        self._looks = looks
        self._on_look = on_look

    def execute(self, query: object, params: object = None, prepare: bool = False) -> _Result:
        self._looks.append(1)
        self._on_look()
        return _Result((7, 1, False))


class _Parts:
    """Parts that are all busy until the test lets one wait; every sleep of the probe
    while none waits is counted."""

    def __init__(self) -> None:
        self.part_waits = False
        self.sleeps = 0
        self.nudge = threading.Event()

    def waiting(self) -> bool:
        return self.part_waits

    def wait_for_waiting(self, timeout: float) -> None:
        self.sleeps += 1
        self.nudge.wait(timeout)
        self.nudge.clear()


def _probe(
    parts: _Parts,
    looks: list[int],
    wakes: list[object],
    on_look: Callable[[], None] = lambda: None,
) -> CommitProbe:
    @contextmanager
    def connection() -> Iterator[Any]:
        yield _Connection(looks, on_look)

    return CommitProbe(
        connection, "public", wakes.append, interval=0.001, idle_interval=0.01, waiters=parts
    )


def test_the_probe_does_not_query_while_every_part_is_busy() -> None:
    parts, looks, wakes = _Parts(), [], []
    probe = _probe(parts, looks, wakes)
    probe.start()
    try:
        wait_until(lambda: parts.sleeps >= 3, what="the probe sleeping while parts are busy")
    finally:
        probe.stop()
        probe.join(10)
    assert looks == []
    assert wakes == []


def test_the_probe_looks_and_wakes_as_soon_as_a_part_waits() -> None:
    parts, looks, wakes = _Parts(), [], []
    probe = _probe(parts, looks, wakes)
    probe.start()
    try:
        wait_until(lambda: parts.sleeps >= 1, what="the probe sleeping while parts are busy")
        assert looks == []
        parts.part_waits = True
        parts.nudge.set()
        wait_until(lambda: len(looks) >= 2, what="the probe looking again")
    finally:
        probe.stop()
        probe.join(10)
    # Its first look wakes every part; the newest row does not move after it.
    assert wakes == [None]


class _Sleeps(threading.Event):
    """The probe's stop flag, noting how long it sleeps between looks."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.lengths.append(timeout)
        return super().wait(timeout)


def _sleeps_between_looks(
    monkeypatch: pytest.MonkeyPatch,
    parts: _Parts,
    looks: int,
    scenario: Callable[[list[int]], None] = lambda looked: None,
) -> list[float]:
    """Run the probe over ``parts`` until its ``looks``-th look (``scenario`` sees the
    looks so far after each); how long it slept after each look."""
    looked: list[int] = []
    sleeps = _Sleeps()

    def on_look() -> None:
        scenario(looked)
        if len(looked) == looks:
            sleeps.set()  # stop after this look

    probe = _probe(parts, looked, [], on_look)
    monkeypatch.setattr(probe, "_stopping", sleeps)
    probe.start()
    probe.join(30)
    assert not probe.is_alive()
    assert len(looked) == looks
    return sleeps.lengths


def _starts_waiting(
    monkeypatch: pytest.MonkeyPatch, parts: _Parts, then: Callable[[], None]
) -> None:
    """The busy parts start waiting (after ``then``) as soon as the probe sleeps on them."""
    original = parts.wait_for_waiting

    def starts_waiting(timeout: float) -> None:
        then()
        parts.part_waits = True
        original(timeout)

    monkeypatch.setattr(parts, "wait_for_waiting", starts_waiting)


def test_a_part_that_catches_up_after_a_long_drain_gets_the_short_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Busy parts are news: the idle slow-down counts from the end of the drain, not
    # from the probe's last change before it.
    clock = [0.0]
    monkeypatch.setattr(probe_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    parts = _Parts()
    parts.part_waits = True

    def scenario(looked: list[int]) -> None:
        if len(looked) == 2:  # 100 s without news: idle; then the part drains a backlog
            clock[0] = 100.0
            parts.part_waits = False

    def drained() -> None:  # a second later
        clock[0] = 101.0

    _starts_waiting(monkeypatch, parts, then=drained)
    sleeps = _sleeps_between_looks(monkeypatch, parts, 3, scenario)
    # After the first look, the idle one, then a quick look: the part has just caught up.
    assert sleeps == pytest.approx([0.001, 0.01, 0.001 / probe_module._QUICK_FACTOR])


def test_a_part_that_starts_waiting_gets_a_few_quick_looks_then_the_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parts = _Parts()
    quick = probe_module._QUICK_LOOKS
    _starts_waiting(monkeypatch, parts, then=lambda: None)
    sleeps = _sleeps_between_looks(monkeypatch, parts, quick + 3)
    # Busy at first: no look until the part waits; then quick looks, then the interval
    # for as long as it keeps waiting.
    fast = 0.001 / probe_module._QUICK_FACTOR
    assert sleeps == pytest.approx([fast] * quick + [0.001] * 3)


def test_parts_that_wait_from_the_start_get_no_quick_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An idle relay: its parts never drained anything, so nothing just caught up.
    parts = _Parts()
    parts.part_waits = True
    assert _sleeps_between_looks(monkeypatch, parts, 3) == [0.001, 0.001, 0.001]
