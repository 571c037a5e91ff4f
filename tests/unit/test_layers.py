"""The layers: the part worker and the daemon's logic reach the database through the
ports (relay/ports.py) only, so importing them never imports its client. Read from the
source: the imports each module runs when imported, followed through the relay's own
modules (relay/__init__.py, which every import of the package runs, re-exports the
write API and is left out). relay.daemon.lifecycle, which wires the Postgres adapters
in, and relay.daemon.startup, which checks the schema's migrations on a connection, do
import it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules that must not reach psycopg, however indirectly.
BEHIND_THE_PORTS = [
    "relay.ports",
    "relay.worker",
    "relay.sessions",
    "relay.testing",
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


def _imports(path: Path) -> set[str]:
    """The modules importing ``path`` imports: its module-level import statements (in
    classes, ifs and trys too), not those of ``if TYPE_CHECKING:`` nor the ones inside
    functions, which run when called (``from a import b`` may import the module ``a.b``:
    both are counted)."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def import_chain(start: str, target: str) -> list[str] | None:
    """The modules through which ``start`` imports ``target`` (a top-level package),
    or None when it does not."""
    came_from: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        module = todo.pop()
        path = _source(module)
        if path is None:
            continue
        for imported in sorted(_imports(path)):
            top = imported.split(".")[0]
            if top == target:
                chain = [imported, module]
                while (parent := came_from[chain[-1]]) is not None:
                    chain.append(parent)
                return chain[::-1]
            inside = top == "relay" and imported != "relay" and _source(imported) is not None
            if inside and imported not in came_from:
                came_from[imported] = module
                todo.append(imported)
    return None


@pytest.mark.parametrize("module", BEHIND_THE_PORTS)
def test_the_logic_behind_the_ports_never_imports_the_database_client(module: str) -> None:
    chain = import_chain(module, "psycopg")
    assert chain is None, f"{module} imports psycopg: {' -> '.join(chain or [])}"


def test_the_check_finds_an_import_of_the_client() -> None:
    """The check itself: the Postgres store does import it."""
    assert import_chain("relay.daemon.lifecycle", "psycopg") is not None
