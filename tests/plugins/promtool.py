"""``promtool``, Prometheus's own checker of rule files, for the tests of
deploy/prometheus/alerts.yml (``promtool`` fixture: the path of the binary), built with
``go install`` as tests/plugins/gotool.py says.

It is built without Prometheus's service discoveries (tag ``remove_all_sd``: the rules
need none), which leaves about 160 MB of modules to download into Go's own cache (800
MB unpacked) and some 1,100 packages to compile: about 15 minutes once on two busy
cores.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.plugins.gotool import GoTool, build_main, run_tool

# Prometheus 3.x publishes its Go module as v0.3MM.P for release 3.MM.P.
PROMTOOL = GoTool(
    "github.com/prometheus/prometheus",
    "cmd/promtool",
    "v0.316.0",
    "h1:f1GRFerhTMKQma+awCoC9T820ecWeGSdF+xAlMHzZzM=",
    tags=("remove_all_sd",),
)


def run_promtool(promtool: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_tool(promtool, *args)


@pytest.fixture(scope="session")
def promtool() -> Path:
    """The pinned promtool, built on first use."""
    return PROMTOOL.binary()


if __name__ == "__main__":
    build_main(PROMTOOL)
