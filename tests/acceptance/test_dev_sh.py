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


def test_dev_sh_demo_on_a_fresh_clone_installs_the_relay_alone_and_runs() -> None:
    with local_workdir("outbox-dev-sh-", "clone") as folder:
        clone = _clone(folder)
        env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
        ran = subprocess.run(
            ["./dev.sh", "demo", "--duration", "10", "--rate", "100"],
            cwd=clone, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=780, check=False,
        )  # fmt: skip
        assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
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
        again = subprocess.run(
            ["./dev.sh", "demo", "--duration", "3", "--rate", "50"],
            cwd=clone, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        assert "dev.sh: installing" not in again.stderr
