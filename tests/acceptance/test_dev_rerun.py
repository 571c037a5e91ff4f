"""Issue #28: the demo's second run in one workdir counts only its own events (it
reported "consumed 9478" for 3,772 published: the first run's records as well)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_dev import ROOT, _cli
from tests.support import local_workdir


@pytest.fixture
def workdir() -> Iterator[Path]:
    with local_workdir("outbox-dev-rerun-", "dev") as folder:
        yield folder


def _summary(workdir: Path, duration: int) -> dict[str, int | str]:
    argv = ["dev", "--duration", str(duration), "--rate", "200", "--workdir", str(workdir)]
    result = subprocess.run(
        [*_cli(), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = output[output.index("Summary:") :]
    figures: dict[str, int | str] = {"output": output[-3000:]}
    for name, pattern in (
        ("published", r"Published (\d+) events"),
        ("consumed", r"consumed (\d+)"),
        ("duplicates", r"(\d+) duplicates"),
    ):
        match = re.search(pattern, summary)
        assert match, f"{pattern!r} not in {summary}"
        figures[name] = int(match[1])
    return figures


def test_a_second_demo_run_counts_only_its_own_events(workdir: Path) -> None:
    # The first run on a new broker waits for its transaction coordinator to load.
    first = _summary(workdir, 15)
    assert int(first["consumed"]) > 0
    second = _summary(workdir, 6)
    assert int(second["published"]) > 0 and second["duplicates"] == 0, second
    # Consumed: what this run published (the consumer may not have read the very last).
    assert int(second["consumed"]) <= int(second["published"]), second
