"""``--help`` off a terminal (piped, in CI, in a pager): not cut at rich's 80 columns,
where option names and the variables they read came out truncated (issue #52)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO


def test_help_off_a_terminal_shows_every_option_and_variable_whole() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "relay", "topics", "tail", "--help"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[RELAY_SCHEMA_REGISTRY_URL]" in done.stdout
    assert "…" not in done.stdout
