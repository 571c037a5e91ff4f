"""Command-line tools the tests need, built from their Go modules at a pinned version
with ``go install`` (the Go module proxy is reachable where the project's tests run;
the tools' release binaries may not be).

Each tool pins its module's hash as Go's checksum database records it, checked before
the build; the module's go.sum then fixes every dependency, each checked against the
checksum database too (``GOSUMDB`` is forced on, nothing exempted), so the pin fixes
the code. A tool is built once per machine into the cache the project's other fetched
artifacts use (``RELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/outbox-relay``), at
``<cache>/<name>/<version>/<name>``, under a file lock, and reused after. A test that
needs one fails, saying why, when it cannot be built (no ``go``, the proxy unreachable,
a hash that differs): it never skips, so CI always runs those tests.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from relay.artifacts.maven import cache_dir

_log = logging.getLogger(__name__)

_BUILD_TIMEOUT_S = 1500
# What `go` prints when it cannot reach the module proxy (or its checksum database).
_UNREACHABLE = re.compile(
    r"dial tcp|no such host|connection refused|i/o timeout|TLS handshake timeout"
    r"|network is unreachable|proxyconnect|Temporary failure in name resolution"
)


@dataclass(frozen=True)
class GoTool:
    """One pinned tool: ``go install <module>/<package>@<version>``."""

    module: str
    package: str  # the main package's path inside the module
    version: str
    module_sum: str  # `go mod download -json <module>@<version>`'s Sum
    tags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The binary's name (its package's), and its cache folder's."""
        return self.package.rsplit("/", 1)[-1]

    @property
    def home(self) -> Path:
        return cache_dir().parent / self.name / self.version

    def binary(self) -> Path:
        """The tool, built on first use."""
        built = self.home / self.name
        if built.exists():
            return built
        go = shutil.which("go")
        if go is None:
            pytest.fail(f"{self.name} is built with Go (tests/plugins/gotool.py): install Go 1.26+")
        self.home.mkdir(parents=True, exist_ok=True)
        with (self.home / ".build.lock").open("w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # the cache is shared by every run of the machine
            return built if built.exists() else self._build(go)

    def _build(self, go: str) -> Path:
        """The module checked against its pinned hash, then ``go install`` into a staging
        folder, moved into place whole."""
        staging = Path(tempfile.mkdtemp(dir=self.home, prefix=".build-"))
        try:
            env = _go_env(staging)
            target = f"{self.module}@{self.version}"
            fetched = json.loads(_go(go, env, "mod", "download", "-json", target))
            if fetched.get("Sum") != self.module_sum:
                pytest.fail(
                    f"{target} has hash {fetched.get('Sum')}, not the pinned {self.module_sum}"
                )
            _log.info("building %s (%s) with go install: first use, minutes", self.name, target)
            tags = ["-tags", ",".join(self.tags)] if self.tags else []
            _go(go, env, "install", *tags, f"{self.module}/{self.package}@{self.version}")
            built = self.home / self.name
            (staging / self.name).rename(built)  # a half-written binary is never taken
            return built
        finally:
            shutil.rmtree(staging, ignore_errors=True)


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


def run_tool(
    binary: Path, *args: str | Path, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # the exit code is the verdict
        [str(binary), *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def build_main(tool: GoTool) -> None:
    """`python -m tests.plugins.<tool>`: `./dev.sh test` starts the builds so in the
    background, so that their minutes on a fresh machine overlap lint, typing and the
    tests before the ones that need them (which wait on the build's file lock)."""
    try:
        print(tool.binary())
    except pytest.fail.Exception as exc:
        sys.exit(f"{tool.name}: {exc}")
