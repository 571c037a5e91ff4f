"""The README's first command on a fresh clone: ``./dev.sh demo`` creates the virtualenv,
installs what the demo needs and no more (issue #52: Spark and the benchmarks' extras
only on demand), says so as it goes, and runs the embedded stack."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO, local_workdir

pytestmark = pytest.mark.timeout(900)


def _clone(into: Path) -> Path:
    """A fresh clone of this checkout's commit: what a new user has after `git clone`."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(into)], check=True)
    return into


def _demo(clone: Path, seconds: int, timeout: float) -> subprocess.CompletedProcess[str]:
    """``./dev.sh demo`` in ``clone``, as a new user's shell runs it (no venv active)."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    ran = subprocess.run(
        ["./dev.sh", "demo", "--duration", str(seconds), "--rate", "100"],
        cwd=clone, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    return ran


def test_dev_sh_demo_on_a_fresh_clone_installs_the_relay_alone_and_runs() -> None:
    with local_workdir("outbox-dev-sh-", "clone") as folder:
        clone = _clone(folder)
        ran = _demo(clone, 10, timeout=780)
        # The install talks (a first run is minutes of silence otherwise).
        assert "dev.sh: creating .venv" in ran.stderr
        assert "dev.sh: installing outbox-relay into .venv" in ran.stderr
        # The demo ran: its summary counts what it wrote and what arrived.
        assert " written " in ran.stdout, ran.stdout[-2000:]
        # Installed: the relay alone, remembered as the demo's set.
        venv = clone / ".venv"
        assert (venv / ".installed-demo").exists()
        assert not (venv / ".installed-all").exists()
        missing = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import pyspark"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert missing.returncode != 0, "the demo installed Spark"
        # A second run finds it installed and says nothing of installing.
        again = _demo(clone, 3, timeout=300)
        assert "dev.sh: installing" not in again.stderr
