"""The release path of docs/operations.md ("Making a release"), as written: the version
in one place, the wheel and sdist `python -m build` makes, and that wheel installed in a
clean virtual environment the way the image installs it, then run."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import psycopg

from tests.support import REPO, fenced_blocks, run_cli

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_written_once_and_the_changelog_heads_with_it() -> None:
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"outbox-relay {VERSION}\n"
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings and headings[0] == VERSION


def test_the_built_wheel_installs_in_a_clean_venv_and_migrates(
    tmp_path: Path, database_url: str
) -> None:
    dist = tmp_path / "dist"
    [build] = [b for b in fenced_blocks(REPO / "docs" / "operations.md", "bash") if "build" in b]
    command = build.strip().split()
    assert command == ["python", "-m", "build", "--outdir", "dist", "."]
    built = subprocess.run(
        [sys.executable, *command[1:4], str(dist), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert sorted(p.name for p in dist.iterdir()) == [
        f"outbox_relay-{VERSION}-py3-none-any.whl",
        f"outbox_relay-{VERSION}.tar.gz",
    ]
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    for step in (
        [sys.executable, "-m", "venv", str(venv)],
        # As the Dockerfile installs it: the locked dependencies, each checked against
        # its hash, then the wheel alone.
        [python, "-m", "pip", "install", "--quiet", "--require-hashes", "--no-deps",
         "-r", REPO / "requirements.lock"],
        [python, "-m", "pip", "install", "--quiet", "--no-deps",
         dist / f"outbox_relay-{VERSION}-py3-none-any.whl"],
    ):  # fmt: skip
        done = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
    installed = venv / "bin" / "outbox-relay"
    # Run from elsewhere: the checkout's relay/ must not be what is imported.
    version = _run(installed, "--version", cwd=tmp_path)
    assert version.stdout == f"outbox-relay {VERSION}\n"
    migrated = _run(installed, "migrate", "--database-url", database_url, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT to_regclass('public.outbox') IS NOT NULL").fetchone() == (True,)


def _run(program: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(program), *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done
