"""The import rules of docs/design.md, "The map": which group of modules may import
which, and that the logic behind the ports never reaches the database client. Read from
the source (AST), so the rules hold for every module, imported by a test or not.

The rules count every import statement, in functions and under ``if TYPE_CHECKING:``
too: each is a dependency. The database-client check counts the imports that run when a
module is imported (module level, in classes, ifs and trys, not ``if TYPE_CHECKING:``
nor functions); importing ``a.b.c`` runs the packages' ``__init__`` modules first
(``a``, ``a.b``), so they are followed too, all but ``relay/__init__.py``, which every
import of the package runs and which re-exports the write API.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("relay", "spark_jobs")

# Each module of relay/ and spark_jobs/ belongs to exactly one group: the first whose
# patterns match its name. A group is a folder; relay.errors stays at the top, as the
# exceptions' qualified names appear in output. docs/design.md's map says what each may
# import (MAY_IMPORT, read from it).
GROUPS: dict[str, tuple[str, ...]] = {
    "write API": ("relay", "relay.write", "relay.write.*"),
    # relay.adapters holds a docstring only.
    "core": ("relay.errors", "relay.core", "relay.core.*", "relay.adapters"),
    "engine": ("relay.engine", "relay.engine.*"),
    "postgres": ("relay.adapters.postgres", "relay.adapters.postgres.*"),
    "kafka": ("relay.adapters.kafka", "relay.adapters.kafka.*"),
    "registry": ("relay.adapters.registry", "relay.adapters.registry.*"),
    "sinks": ("relay.adapters.sinks", "relay.adapters.sinks.*"),
    "memory": ("relay.adapters.memory",),
    "ops": ("relay.ops", "relay.ops.*"),
    "observability": ("relay.observability", "relay.observability.*"),
    "wiring": ("relay.wiring",),
    "daemon": ("relay.daemon", "relay.daemon.*"),
    "cli": ("relay.cli", "relay.cli.*", "relay.__main__"),
    "localstack": ("relay.localstack", "relay.localstack.*"),
    "artifacts": ("relay.artifacts", "relay.artifacts.*"),
    "spark_jobs": ("spark_jobs", "spark_jobs.*"),
}


def _design_map() -> dict[str, set[str]]:
    """What each group may import besides itself: the table of docs/design.md's §10,
    read here, so that the map the maintainers read is the one the imports are held to."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## 10. The map\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]  # past its head
    found: dict[str, set[str]] = {}
    for row in rows:
        group, _, may, *_ = (cell.strip() for cell in row.strip("|").split("|"))
        found[group] = set() if may == "nothing" else {g.strip() for g in may.split(",")}
    return found


MAY_IMPORT = _design_map()
# The imports against the rules, each for a reason; they count as arrows of the map too.
EXCEPTIONS: set[tuple[str, str]] = set()


# Modules that must not reach psycopg, however indirectly: the part worker and the
# daemon's logic reach the database through the ports (relay/core/ports.py) only.
# relay.daemon.lifecycle, which imports the composition root (relay.wiring), and
# relay.daemon.startup, which checks the schema's migrations, do import it.
BEHIND_THE_PORTS = [
    "relay.core.ports",
    "relay.engine.worker",
    "relay.engine.batch_publisher",
    "relay.engine.sessions",
    "relay.adapters.memory",
    "relay.daemon.context",
    "relay.daemon.membership",
    "relay.daemon.parts",
    "relay.daemon.upkeep",
]


def _source(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def group_of(module: str) -> str | None:
    matching = (g for g, patterns in GROUPS.items() if any(fnmatch(module, p) for p in patterns))
    return next(matching, None)


def _statements(path: Path, *, when_imported: bool) -> list[ast.AST]:
    """Every statement of ``path``; ``when_imported``: only those that run when it is
    imported (module level, in classes, ifs but ``if TYPE_CHECKING:``, trys, withs)."""
    tree = ast.parse(path.read_text())
    if not when_imported:
        return list(ast.walk(tree))
    found: list[ast.AST] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def imports(module: str, *, when_imported: bool = False) -> set[str]:
    """The modules ``module`` imports: ``from a import b`` imports ``a.b`` when that is
    a module, else ``a``."""
    path = _source(module)
    assert path is not None, module
    found: set[str] = set()
    for node in _statements(path, when_imported=when_imported):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= {n for n in names if _source(n) is not None}
            if any(_source(n) is None for n in names):
                found.add(node.module)
    return found


def _with_packages(module: str) -> list[str]:
    """``module`` and the packages whose ``__init__`` importing it runs first, but
    ``relay`` itself."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)] or [module]


def import_chain(start: str, target: str) -> list[str] | None:
    """The modules through which importing ``start`` imports ``target`` (a top-level
    package), or None when it does not."""
    came_from: dict[str, str | None] = {m: None for m in _with_packages(start)}
    todo = list(came_from)
    while todo:
        module = todo.pop()
        if _source(module) is None:
            continue
        for imported in sorted(imports(module, when_imported=True)):
            if imported.split(".")[0] == target:
                chain = [imported, module]
                while (parent := came_from[chain[-1]]) is not None:
                    chain.append(parent)
                return chain[::-1]
            for step in _with_packages(imported):
                inside = step.startswith("relay.") and _source(step) is not None
                if inside and step not in came_from:
                    came_from[step] = module
                    todo.append(step)
    return None


def test_every_module_is_in_one_group_of_the_map() -> None:
    assert [m for m in _modules() if group_of(m) is None] == []
    assert set(MAY_IMPORT) == set(GROUPS)


def _floors(may_import: dict[str, set[str]]) -> list[str]:
    """The groups in an order where each comes after all it may import: a
    :class:`graphlib.CycleError` names the loop when there is none."""
    arrows = {group: set(allowed) for group, allowed in may_import.items()}
    for module, imported in EXCEPTIONS:
        arrows[group_of(module) or module].add(group_of(imported) or imported)
    return list(graphlib.TopologicalSorter(arrows).static_order())


def test_the_groups_import_each_other_in_no_loop() -> None:
    """The map is a directed acyclic graph, its exceptions counted as arrows: each group
    stands above all it imports, and none reaches back to one that imports it."""
    floors = _floors(MAY_IMPORT)
    assert floors[0] == "core" and set(floors) == set(GROUPS)


def test_the_sort_finds_a_loop() -> None:
    """The check itself: were the core to import the daemon, the map would hold a loop."""
    with pytest.raises(graphlib.CycleError):
        _floors({**MAY_IMPORT, "core": {"daemon"}})


def test_importing_the_write_api_loads_neither_the_relay_nor_kafka() -> None:
    """``import relay`` is what an application runs to append events: it brings the
    write API and its Postgres adapter, never the engine, the daemon, the tracing of the
    relay's side or the Kafka client. Asked of a new interpreter: this one has them all."""
    heavy = ("relay.engine", "relay.observability", "relay.daemon", "confluent_kafka")
    probe = f"import relay, sys; print(sorted(m for m in sys.modules if m.startswith({heavy})))"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "[]"


def _broken_rules(module: str) -> list[str]:
    group = group_of(module)
    assert group is not None
    allowed = MAY_IMPORT[group] | {group}
    found = []
    for imported in sorted(imports(module)):
        if imported.split(".")[0] not in PACKAGES:
            continue
        other = group_of(imported)
        if other not in allowed and (module, imported) not in EXCEPTIONS:
            found.append(f"{module} ({group}) imports {imported} ({other})")
    return found


@pytest.mark.parametrize("module", _modules())
def test_each_module_imports_only_the_groups_its_group_may(module: str) -> None:
    assert _broken_rules(module) == []


@pytest.mark.parametrize("module", BEHIND_THE_PORTS)
def test_the_logic_behind_the_ports_never_imports_the_database_client(module: str) -> None:
    chain = import_chain(module, "psycopg")
    assert chain is None, f"{module} imports psycopg: {' -> '.join(chain or [])}"


def test_the_check_finds_an_import_of_the_client() -> None:
    """The check itself: the Postgres store does import it, and so does a module whose
    package's ``__init__`` imports it."""
    assert import_chain("relay.daemon.lifecycle", "psycopg") is not None
    assert import_chain("relay.localstack.process", "psycopg") == [
        "relay.localstack",
        "relay.localstack.postgres",
        "psycopg",
    ]


def test_the_rules_catch_an_import_against_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: were the core to import the daemon, it would fail."""
    monkeypatch.setattr(sys.modules[__name__], "imports", lambda module: {"relay.daemon.parts"})
    assert _broken_rules("relay.errors") == [
        "relay.errors (core) imports relay.daemon.parts (daemon)"
    ]


# Where the concrete store (relay.adapters.postgres.store) may be named: the adapters,
# the composition root that builds it, and the CLI, which hands it to ``ops``; no other
# module names it (each list here is for a module that must, with its reason).
STORE_NAMED: set[str] = set()


def _where_the_store_is_named() -> set[str]:
    return {
        m
        for m in _modules()
        if group_of(m) not in ("postgres", "kafka", "registry", "wiring", "cli")
        and "relay.adapters.postgres.store" in imports(m)
    }


def test_only_the_composition_root_wires_the_store() -> None:
    """The daemon, metrics, ``ops`` and the local stack get their store from
    ``relay.wiring`` or their caller, as a port (relay/core/ports.py)."""
    assert _where_the_store_is_named() == STORE_NAMED


# Modules of ``ops`` and the CLI that still import an adapter (relay.adapters.*), each
# for a reason; every other one gets its adapters from ``relay.wiring`` or its caller,
# as ports (issue #50).
ADAPTERS_NAMED = {
    # Run DDL and role grants of their own on the command's connection (the Postgres
    # adapter's SQL and its search path): schema tools, not yet behind a port.
    "relay.ops.debezium",
    "relay.ops.roles",
    # `migrate` applies the adapter's migrations (its lock wait is an option's default).
    "relay.cli.operations",
    # `topics list|create|describe` are the Kafka adapter's admin calls, shown as they are.
    "relay.cli.topics",
}


def _where_an_adapter_is_named() -> set[str]:
    return {
        m
        for m in _modules()
        if group_of(m) in ("ops", "cli")
        and any(i.startswith("relay.adapters.") for i in imports(m))
    }


def test_ops_and_the_cli_take_ports_not_adapters() -> None:
    """``ops`` and the CLI import no adapter but the few listed with their reasons: the
    composition root (relay.wiring) builds the store, publishers and readers."""
    assert _where_an_adapter_is_named() == ADAPTERS_NAMED


def test_the_adapter_check_finds_an_import_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: were verify to import the Postgres store, it would fail."""
    real = imports
    store = "relay.adapters.postgres.store"

    def with_store(module: str) -> set[str]:
        return real(module) | ({store} if module == "relay.ops.verify" else set())

    monkeypatch.setattr(sys.modules[__name__], "imports", with_store)
    assert _where_an_adapter_is_named() == ADAPTERS_NAMED | {"relay.ops.verify"}


def test_tracing_speaks_no_kafka() -> None:
    """Tracing is OpenTelemetry only: where a record goes is asked of Kafka's
    partitioner (relay.adapters.kafka.partitioner), which the relay hands it."""
    observability = [m for m in _modules() if group_of(m) == "observability"]
    assert [
        m for m in observability if any(i.startswith("confluent_kafka") for i in imports(m))
    ] == []


def test_each_exception_is_an_import_the_rules_would_refuse() -> None:
    for module, imported in EXCEPTIONS:
        assert imported in imports(module), (module, imported)
        assert group_of(imported) not in MAY_IMPORT[group_of(module) or ""], (module, imported)
