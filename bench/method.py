"""The method every headline figure follows (issue #31), shared by the benchmarks.

* **Interleaved repetitions.** :func:`interleave` runs each side of a comparison in
  turn, A B A B …, ``repetitions`` times (5 at ``default`` and ``full``, 3 at ``quick``),
  so a slow minute of a noisy machine lands on both sides rather than on one.
* **Median and range.** A figure's value is the median of its repetitions; the lowest
  and highest are reported beside it (:class:`Samples`). A ratio is the ratio of the
  medians; the range of the ratios of each repetition's pair is reported too.
* **Settled starts.** :func:`settle` runs a CHECKPOINT and pauses after every fill and
  before every repetition, so no run pays for the previous one's dirty pages.
* **Per-process CPU.** :class:`CpuMeter` reads ``utime + stime`` from ``/proc/<pid>/stat``
  before and after a run for the relay, Postgres, the broker (and Debezium, where it
  runs), each with its descendants; the children that exited meanwhile are counted
  through their parent's ``cutime + cstime``. For Postgres that is the postmaster and
  every backend. Reported as cores used (CPU seconds over wall seconds) beside each
  throughput.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Samples:
    """The repetitions of one measurement, in the order they were taken."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def as_json(self) -> dict[str, Any]:
        return {"median": self.median, "low": self.low, "high": self.high,
                "values": list(self.values)}  # fmt: skip


def repetitions(scale_name: str) -> int:
    """How many times each side runs: 5 for figures that are taken, 3 to try the method."""
    return 3 if scale_name == "quick" else 5


def interleave(
    sides: Mapping[str, Callable[[], float]],
    times: int,
    *,
    before_each: Callable[[], None] | None = None,
) -> dict[str, Samples]:
    """Run every side once per round for ``times`` rounds, every other round in reverse
    (A B, B A, A B …): these runs get faster round after round (a warming cache, JIT,
    the broker's log), so a side always run first would pay for it. ``before_each``
    (e.g. :func:`settle`) runs before every run of every side."""
    values: dict[str, list[float]] = {name: [] for name in sides}
    forward = list(sides.items())
    for round_ in range(times):
        for name, measure in forward if round_ % 2 == 0 else reversed(forward):
            if before_each is not None:
                before_each()
            values[name].append(measure())
    return {name: Samples(tuple(v)) for name, v in values.items()}


def ratio_range(value: Samples, baseline: Samples) -> tuple[float, float] | None:
    """The lowest and highest ratio of one round's value to the same round's baseline."""
    pairs = [v / b for v, b in zip(value.values, baseline.values, strict=True) if b]
    return (min(pairs), max(pairs)) if pairs else None


def settle(url: str, pause: float = 2.0) -> None:
    """CHECKPOINT (the dirty pages of the last fill or run go to disk now, not during the
    next window), then let the machine go quiet for ``pause`` seconds."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    time.sleep(pause)


# -- CPU per process ------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, own CPU seconds, reaped children's CPU seconds) of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and ')'
    # After the name: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based
    # over the whole line; here 0-based from the state.
    ppid = int(fields[1])
    own = (int(fields[11]) + int(fields[12])) / _TICK
    reaped = (int(fields[13]) + int(fields[14])) / _TICK
    return ppid, own, reaped


def own_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by ``pid``'s own threads; None when it is gone."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds used by ``root`` and its descendants, living or reaped; None when
    ``root`` is gone."""
    stats: dict[int, tuple[int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            _, own, reaped = stats[pid]
            total += own + reaped
            todo.extend(children.get(pid, []))
    return total


class CpuMeter:
    """CPU used by named process trees over a ``with`` block.

    ``roots`` maps a name ("relay", "postgres", "broker", ...) to a function that returns
    the root pids of that name when called: a relay started inside the block is found at
    its end, and its CPU then counts from its start. Pids are read at both ends; a tree
    that ended inside the block is not counted (read before it ends, see
    :meth:`sample`).
    """

    def __init__(
        self,
        roots: Mapping[str, Callable[[], Iterable[int | None]]],
        *,
        alone: Iterable[str] = (),
    ) -> None:
        self.roots = roots
        # Names whose processes count without their descendants: the benchmark's own
        # process is the parent of every server and relay it starts.
        self.alone = frozenset(alone)
        self._start: dict[str, dict[int, float]] = {}
        self._last: dict[str, dict[int, float]] = {}
        self._wall = 0.0
        self.seconds: dict[str, float] = {}
        self.cores: dict[str, float] = {}

    def _read(self) -> dict[str, dict[int, float]]:
        read: dict[str, dict[int, float]] = {}
        for name, pids in self.roots.items():
            count = own_cpu_seconds if name in self.alone else tree_cpu_seconds
            used = {pid: count(pid) for pid in pids() if pid is not None}
            # A process gone meanwhile keeps its last reading (see :meth:`sample`).
            read[name] = {pid: cpu for pid, cpu in used.items() if cpu is not None}
        return read

    def __enter__(self) -> CpuMeter:
        self._start = self._read()
        self._wall = time.perf_counter()
        return self

    def sample(self) -> None:
        """Read now: call it before stopping a process whose CPU should count."""
        self._last = self._read()

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        end = self._read()
        for name in self.roots:
            last = {**self._last.get(name, {}), **end.get(name, {})}
            start = self._start.get(name, {})
            used = sum(cpu - start.get(pid, 0.0) for pid, cpu in last.items())
            self.seconds[name] = used
            self.cores[name] = used / wall if wall > 0 else 0.0

    def as_json(self) -> dict[str, float]:
        """Cores used per name (1.0 = one core busy for the whole block)."""
        return {f"cpu_cores_{name}": round(cores, 3) for name, cores in self.cores.items()}
