"""``promtool``, Prometheus's own checker of rule files, for the tests of
deploy/prometheus/alerts.yml (``promtool`` fixture: the path of the binary).

It is built from Prometheus's Go module at a pinned version (``go install``; every
module is checked against Go's checksum database, so the pin fixes the code), once per
machine, into the cache the project's other fetched tools use (``RELAY_CACHE_DIR``, else
``$XDG_CACHE_HOME/outbox-relay``), under a file lock. It is built without Prometheus's
service discoveries (tag ``remove_all_sd``: the rules need none), which leaves about
160 MB of modules to download into Go's own cache (800 MB unpacked) and some 1,100
packages to compile: minutes, once. Tests that need it are skipped, saying why, only when the Go module proxy
cannot be reached (or no Go is installed); a build that fails otherwise fails them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from relay.artifacts.maven import cache_dir

_log = logging.getLogger(__name__)

# Prometheus 3.x publishes its Go module as v0.3MM.P for release 3.MM.P.
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_VERSION = "v0.316.0"
_BUILD_TIMEOUT_S = 1500
# What `go` prints when it cannot reach the module proxy (or its checksum database).
_UNREACHABLE = re.compile(
    r"dial tcp|no such host|connection refused|i/o timeout|TLS handshake timeout"
    r"|network is unreachable|proxyconnect|Temporary failure in name resolution"
)


def _home() -> Path:
    return cache_dir().parent / "promtool" / PROMETHEUS_VERSION


def _build(go: str, home: Path) -> Path:
    """``go install`` into a staging folder, then moved into place whole."""
    staging = Path(tempfile.mkdtemp(dir=home, prefix=".build-"))
    try:
        env = {**os.environ, "GOBIN": str(staging), "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
        target = f"{PROMETHEUS_MODULE}/cmd/promtool@{PROMETHEUS_VERSION}"
        _log.info("building promtool (%s) with go install: first use, minutes", target)
        done = subprocess.run(  # the exit code is the verdict
            [go, "install", "-tags", "remove_all_sd", target],
            check=False,
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
            env=env,
        )
        if done.returncode != 0:
            if _UNREACHABLE.search(done.stderr):
                pytest.skip(
                    f"the Go module proxy is unreachable, so no promtool: {done.stderr[-600:]}"
                )
            pytest.fail(
                f"go install {target} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        built = home / "promtool"
        (staging / "promtool").rename(built)  # a half-written binary is never taken
        return built
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run_promtool(promtool: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # the exit code is the verdict
        [str(promtool), *map(str, args)], check=False, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="session")
def promtool() -> Path:
    """The pinned promtool, built on first use."""
    home = _home()
    binary = home / "promtool"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        pytest.skip("promtool is built with Go, and no `go` is on PATH")
    home.mkdir(parents=True, exist_ok=True)
    with (home / ".build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # the cache is shared by every run of the machine
        return binary if binary.exists() else _build(go, home)
