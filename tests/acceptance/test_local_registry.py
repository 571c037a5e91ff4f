"""`outbox-relay local --registry`: the local stack with a schema registry, whose URL it
prints to export beside the others; an avro-registry subscriber is then added against
it as docs/configuration.md says, with nothing but the printed exports."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, local_workdir, run_cli

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with local_workdir("outbox-local-registry-", "local") as folder:
        yield folder


def exports(local: subprocess.Popen[str], deadline: float) -> dict[str, str]:
    """The variables ``local`` prints to export, once it printed all of them."""
    found: dict[str, str] = {}
    assert local.stdout is not None
    for line in local.stdout:
        assert time.monotonic() < deadline, f"no exports yet: {found}"
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").strip().partition("=")
            found[name] = shlex.split(value)[0]
        elif line.startswith("The URL's password"):
            return found
    raise AssertionError(f"local ended first (exit {local.wait()}): {found}")


def test_local_with_a_registry_prints_its_url_and_serves_avro_registry(workdir: Path) -> None:
    local = subprocess.Popen(
        [sys.executable, "-m", "relay", "local", "--registry", "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, cwd=REPO,
    )  # fmt: skip
    try:
        env = exports(local, time.monotonic() + 900)
        assert set(env) == {
            "RELAY_DATABASE_URL",
            "RELAY_BOOTSTRAP_SERVERS",
            "RELAY_SCHEMA_REGISTRY_URL",
        }
        with urllib.request.urlopen(
            f"{env['RELAY_SCHEMA_REGISTRY_URL']}/subjects", timeout=30
        ) as r:
            assert json.load(r) == []  # a registry, answering, empty
        added = run_cli(
            "subscribers", "add", "orders", "--format", "avro-registry",
            "--schemas-dir", str(REPO / "schemas" / "demo"),
            env={**os.environ, **env}, timeout=300,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
    finally:
        local.send_signal(signal.SIGINT)
        _, stderr = local.communicate(timeout=120)
    assert local.returncode == 0, stderr[-3000:]
