"""Each package importable on its own (#34 item 1): the shipped Spark jobs and the
neutral artifact fetcher never import the local dev stack, and the relay's own error
module knows nothing of the tooling's errors. Read from the source (AST), so the rule
holds for every module, imported by a test or not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (a folder under the repository root) and the modules it
    imports."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("package", ["spark_jobs", "relay/artifacts"])
def test_a_shipped_package_never_imports_the_dev_stack(package: str) -> None:
    offenders = {
        module: sorted(
            n for n in names if n == "relay.localstack" or n.startswith("relay.localstack.")
        )
        for module, names in _imports(package).items()
    }
    assert {m: n for m, n in offenders.items() if n} == {}


def test_the_spark_jobs_maven_locks_ship_beside_the_fetcher() -> None:
    from relay.artifacts.maven import Lock

    assert Lock.load("spark-kafka").artifacts
    assert not list((ROOT / "relay" / "localstack").glob("spark-*.lock"))
