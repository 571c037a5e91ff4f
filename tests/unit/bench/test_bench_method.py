"""The benchmarks' method (bench/method.py): the order runs take, what a figure reports,
and whose CPU is counted. No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from bench.harness import Figure
from bench.method import CpuMeter, Samples, interleave, ratio_range

# Spends 0.3 s of CPU (not of wall time: a loaded machine stretches it, never shortens it).
BURN = "import time\nt0 = time.process_time()\nwhile time.process_time() - t0 < 0.3: pass\n"


def test_sides_alternate_and_each_run_is_settled_first() -> None:
    order: list[str] = []

    def side(name: str, value: float) -> Callable[[], float]:
        def run() -> float:
            order.append(name)
            return value

        return run

    samples = interleave(
        {"a": side("a", 1.0), "b": side("b", 4.0)}, 3, before_each=lambda: order.append("|")
    )
    # Every other round in reverse, so neither side is always the first of its round.
    assert order == ["|", "a", "|", "b", "|", "b", "|", "a", "|", "a", "|", "b"]
    assert samples["a"].values == (1.0, 1.0, 1.0) and samples["b"].values == (4.0,) * 3


def test_a_figure_reports_medians_with_their_ranges() -> None:
    relay, ceiling = Samples((5.0, 1.0, 3.0)), Samples((10.0, 4.0, 5.0))
    figure = Figure.of("b", "f", relay, "ev/s", ceiling, "ceiling", "ratio>=0.5")
    assert (figure.value, figure.baseline, figure.repetitions) == (3.0, 5.0, 3)
    assert figure.value_range == (1.0, 5.0) and figure.baseline_range == (4.0, 10.0)
    assert figure.ratio_range == ratio_range(relay, ceiling) == (0.25, 0.6)
    assert figure.met is True  # 3 / 5
    assert figure.as_json()["ratio_range"] == (0.25, 0.6)


def test_cpu_counts_a_process_and_its_children_also_once_they_exited() -> None:
    # The parent starts, says so, runs a child that burns 0.3 s and exits (reaped), burns
    # 0.3 s itself, says so, and waits to be killed.
    script = (
        "import subprocess, sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
        f"subprocess.run([sys.executable, '-c', {BURN!r}])\n{BURN}"
        "print('done', flush=True)\nsys.stdin.readline()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        assert parent.stdout.readline() == "ready\n"  # its own start-up is before the block
        with CpuMeter({"parent": lambda: [parent.pid]}) as meter:
            parent.stdin.write("go\n")
            parent.stdin.flush()
            assert parent.stdout.readline() == "done\n"
    finally:
        parent.kill()
        parent.wait()
    # Both burns (less a clock tick each), and the child's start-up; not the parent's.
    assert 0.58 <= meter.seconds["parent"] < 2.0


def test_short_rounds_are_grouped_into_repetitions_by_consecutive_blocks() -> None:
    from bench.writes import blocks

    values = [float(v) for v in range(1, 11)]  # 3 blocks: 1-3, 4-6, 7-10 (the rest)
    assert blocks(values, 3).values == (2.0, 5.0, 8.5)
    assert blocks([4.0, 1.0], 5).values == (4.0, 1.0)  # fewer rounds than repetitions
