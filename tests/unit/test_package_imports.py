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


@pytest.mark.parametrize("package", ["spark_jobs", "relay"])
def test_no_module_shadows_the_standard_library(package: str) -> None:
    """``spark-submit spark_jobs/archive.py`` runs the file as a script, so its folder
    comes first on ``sys.path``: a ``spark_jobs/secrets.py`` was imported for Python's
    ``secrets`` (pydantic's import of it) and the job failed before Spark started (#51).
    No module or package at any depth may take a standard library module's name."""
    import sys

    names = {
        str(path.relative_to(ROOT)): path.parent.name if path.stem == "__init__" else path.stem
        for path in (ROOT / package).rglob("*.py")
    }
    assert {path: name for path, name in names.items() if name in sys.stdlib_module_names} == {}
