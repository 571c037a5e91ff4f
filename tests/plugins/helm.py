"""``helm``, for the tests of the chart in deploy/helm/ (``helm`` fixture: the path of
the binary), built with ``go install`` as tests/plugins/gotool.py says.

A test helper, not a relay module: the relay never runs Helm, and users install the
chart with their own. Helm's module is smaller than Prometheus's (cmd/helm pulls in
client-go and the Kubernetes API types, no cloud SDKs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.plugins.gotool import GoTool, build_main

HELM = GoTool(
    "helm.sh/helm/v3", "cmd/helm", "v3.22.0", "h1:n1if5iQgHYsujPAcO5oonH/KiSNUmqmUF0iGVjSF3AU="
)


@pytest.fixture(scope="session")
def helm() -> Path:
    """The pinned helm, built on first use."""
    return HELM.binary()


if __name__ == "__main__":
    build_main(HELM)
