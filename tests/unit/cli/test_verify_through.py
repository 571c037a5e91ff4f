"""``verify --through SINK [PATH]``: PATH from the environment as the relay reads its
secrets (RELAY_SINK_URL, RELAY_SINK_URL_FILE), usage errors before any connection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def verify(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", "verify", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env},
    )  # fmt: skip


def test_without_path_or_its_variables_it_says_where_a_path_comes_from() -> None:
    done = verify("--through", "projection")
    assert done.returncode == 2
    assert "RELAY_SINK_URL_FILE" in done.stderr


def test_the_projection_takes_a_database_url_from_the_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "sink-url"
    secret.write_text("/not/a/url\n")
    done = verify("--through", "projection", RELAY_SINK_URL_FILE=str(secret))
    assert done.returncode == 2
    assert "takes the projection database's URL" in done.stderr


def test_an_unknown_sink_names_the_known_ones(tmp_path: Path) -> None:
    done = verify("--through", "lake", str(tmp_path))
    assert done.returncode == 2
    assert "archive, delta, projection" in done.stderr
