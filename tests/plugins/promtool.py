"""``promtool``, Prometheus's own checker of rule files, for the tests of
deploy/prometheus/alerts.yml (``promtool`` fixture: the path of the binary).

It is built from Prometheus's Go module at a pinned version with ``go install`` (the
Go module proxy is reachable where the project's tests run; Prometheus's release
binaries are not). The module's checksum is pinned here and checked before the build:
its go.sum then fixes every dependency, each checked against Go's checksum database
too, so the pin fixes the code. The binary is built once per machine, into the cache
the project's other fetched tools use (``RELAY_CACHE_DIR``, else
``$XDG_CACHE_HOME/outbox-relay``), under a file lock. It is built without Prometheus's
service discoveries (tag ``remove_all_sd``: the rules need none), which leaves about
160 MB of modules to download into Go's own cache (800 MB unpacked) and some 1,100
packages to compile: about 15 minutes once on two busy cores. A test that needs it
fails, saying why, when it cannot be built (no ``go``, the proxy unreachable, a
checksum that differs): it never skips, so CI always runs the rules' tests.
"""

from __future__ import annotations

import fcntl
import json
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
# The module's hash as Go's checksum database records it (`go mod download -json`).
PROMETHEUS_SUM = "h1:f1GRFerhTMKQma+awCoC9T820ecWeGSdF+xAlMHzZzM="
_BUILD_TIMEOUT_S = 1500
# What `go` prints when it cannot reach the module proxy (or its checksum database).
_UNREACHABLE = re.compile(
    r"dial tcp|no such host|connection refused|i/o timeout|TLS handshake timeout"
    r"|network is unreachable|proxyconnect|Temporary failure in name resolution"
)


def _home() -> Path:
    return cache_dir().parent / "promtool" / PROMETHEUS_VERSION


def _go_env(gobin: Path) -> dict[str, str]:
    """The machine's Go settings, less any that would skip a checksum."""
    env = {k: v for k, v in os.environ.items() if k not in {"GONOSUMDB", "GONOSUMCHECK"}}
    return {
        **env,
        "GOBIN": str(gobin),
        "GOFLAGS": "-mod=mod",
        "CGO_ENABLED": "0",
        "GOSUMDB": "sum.golang.org",
        "GOPRIVATE": "",
        "GOINSECURE": "",
        "GONOSUMDB": "",
    }


def _go(go: str, env: dict[str, str], *args: str) -> str:
    """Run ``go ARGS``; its stdout, or the test fails saying what went wrong."""
    done = subprocess.run(  # the exit code is the verdict
        [go, *args], check=False, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, env=env
    )
    if done.returncode != 0:
        why = "the Go module proxy is unreachable" if _UNREACHABLE.search(done.stderr) else ""
        pytest.fail(
            f"go {' '.join(args)} failed (exit {done.returncode}) {why}:\n{done.stderr[-3000:]}"
        )
    return done.stdout


def _build(go: str, home: Path) -> Path:
    """The module checked against its pinned hash, then ``go install`` into a staging
    folder, moved into place whole."""
    staging = Path(tempfile.mkdtemp(dir=home, prefix=".build-"))
    try:
        env = _go_env(staging)
        target = f"{PROMETHEUS_MODULE}@{PROMETHEUS_VERSION}"
        fetched = json.loads(_go(go, env, "mod", "download", "-json", target))
        if fetched.get("Sum") != PROMETHEUS_SUM:
            pytest.fail(f"{target} has hash {fetched.get('Sum')}, not the pinned {PROMETHEUS_SUM}")
        _log.info("building promtool (%s) with go install: first use, minutes", target)
        _go(
            go,
            env,
            "install",
            "-tags",
            "remove_all_sd",
            f"{PROMETHEUS_MODULE}/cmd/promtool@{PROMETHEUS_VERSION}",
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
    return _promtool()


def _promtool() -> Path:
    home = _home()
    binary = home / "promtool"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        pytest.fail(
            "promtool is built with Go (tests/plugins/promtool.py): install Go 1.26.7+ (the pinned module asks for it)"
        )
    home.mkdir(parents=True, exist_ok=True)
    with (home / ".build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # the cache is shared by every run of the machine
        return binary if binary.exists() else _build(go, home)


if __name__ == "__main__":
    # `./dev.sh test` starts the build here in the background, so that its minutes on a
    # fresh machine overlap lint, typing and the tests before the rules' (which wait on
    # the build's file lock).
    import sys

    try:
        print(_promtool())
    except pytest.fail.Exception as exc:
        sys.exit(f"promtool: {exc}")
