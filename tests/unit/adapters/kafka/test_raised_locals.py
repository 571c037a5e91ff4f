"""No Kafka adapter raises an exception a local of its frame still holds (#53).

A raised exception's traceback holds the raising frame; if a local of that frame holds
the exception (``raise refused[0]``, ``raise failure``), the two form a cycle that only
the cyclic garbage collector frees, and a relay runs it rarely (``tune_gc``). Every
object of the frame waits with them: a publisher and its librdkafka client's threads.
1,000 parts ran hundreds of closed clients that way. So each such raise sits in a
``try`` whose ``finally`` lets go of the local (``del`` it, or set it to None). Names
an ``except ... as`` binds are exempt: Python deletes them as the handler ends.

Read from the source (AST), so a new raise of the kind fails here before a bench finds
its threads.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

KAFKA = Path(__file__).resolve().parents[4] / "relay" / "adapters" / "kafka"


def _raised_local(node: ast.Raise) -> str | None:
    """The local name a ``raise`` raises through (``raise x``, ``raise x[0]``), if any."""
    target = node.exc
    while isinstance(target, ast.Subscript | ast.Attribute):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def _released(name: str, finalbody: list[ast.stmt]) -> bool:
    """Whether a ``finally`` lets go of ``name``: ``del name`` or ``name = None``."""
    for statement in finalbody:
        for node in ast.walk(statement):
            if isinstance(node, ast.Delete) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return True
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and node.value.value is None
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            ):
                return True
    return False


def _offences(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of each raise through a local that nothing around it lets go of."""

    def visit(node: ast.AST, guards: tuple[ast.AST, ...]) -> Iterator[tuple[int, str]]:
        if isinstance(node, ast.Raise) and node.exc is not None:
            name = _raised_local(node)
            if name is not None and not any(_guards(g, name) for g in guards):
                yield node.lineno, name
        for child in ast.iter_child_nodes(node):
            inner = guards
            # A try's finally covers its body, handlers and else; a handler its own.
            guarded = isinstance(node, ast.Try) and child not in node.finalbody
            if guarded or isinstance(node, ast.ExceptHandler):
                inner = (*guards, node)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                inner = ()  # a nested function's frame is its own
            yield from visit(child, inner)

    yield from visit(tree, ())


def _guards(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.ExceptHandler):
        return node.name == name
    assert isinstance(node, ast.Try)
    return _released(name, node.finalbody)


def _modules() -> list[Path]:
    return sorted(KAFKA.glob("*.py"))


@pytest.mark.parametrize("module", _modules(), ids=lambda p: p.name)
def test_no_raise_keeps_a_cycle_through_a_local(module: Path) -> None:
    offences = list(_offences(ast.parse(module.read_text(), str(module))))
    assert not offences, (
        f"{module.name}: raised through a local no finally lets go of (a cycle that keeps "
        f"the frame, and the client it holds, until the cyclic collector): {offences}"
    )


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("def f(r):\n    if r:\n        raise r[0]\n", True),
        ("def f(w):\n    raise w\n", True),
        ("def f(r):\n    try:\n        raise r[0]\n    finally:\n        del r\n", False),
        ("def f(w):\n    try:\n        raise w\n    finally:\n        w = None\n", False),
        ("def f():\n    try:\n        g()\n    except E as exc:\n        raise exc\n", False),
        ("def f():\n    raise E('x')\n", False),
        (
            "def f(w):\n    try:\n        g()\n    except E:\n        raise w\n    finally:\n        del w\n",
            False,
        ),
        ("def f():\n    try:\n        pass\n    finally:\n        del w\n    raise w\n", True),
    ],
)
def test_the_check_tells_the_shapes_apart(source: str, caught: bool) -> None:
    assert bool(list(_offences(ast.parse(source)))) is caught
