"""The docs' code runs (#34 item 8): the Python blocks of README.md and of the pages of
docs/ are executed against a real Postgres, as the writer role, rather than mirrored by
hand in other tests.

The blocks of one document run in order in one namespace, as a reader pastes them into
one session: a later block may use what an earlier one defined (``outbox``). Each starts
from what the docs take as the application's own: ``conn``, an autocommit connection as
the writer role; ``DATABASE_URL``, its URL; ``log``, a logger; an ``orders`` table with
order 42 (the business row the examples update); the repository as the working
directory (``schemas/``), and ``$RELAY_SCHEMAS_DIR`` set, so the module-level shortcuts
validate as the relay would.

A block that cannot run here (it needs Kafka, Spark or a schema registry, or a consumed
record) is marked illustrative by an HTML comment on the line before its fence, which
renders as nothing: ``<!-- illustrative: why -->``. A bash block that no test can run
(it needs a cloud account) carries the same marker.
"""

from __future__ import annotations

import logging
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.write.outbox import default_outbox
from tests.support import REPO, WRITER_ROLE

# The documents whose blocks run; every other page of docs/ must have no block that runs.
DOCUMENTS = ["README.md", "docs/writing-events.md", "docs/tracing.md"]
PAGES = ["README.md", *sorted(f"docs/{page.name}" for page in (REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\S*)[ \t]*$")
_ILLUSTRATIVE = re.compile(r"^\s*<!-- illustrative: (?P<why>\S.*?) -->\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    code: str
    illustrative: str | None  # why it does not run, when it does not


def python_blocks(document: str) -> list[Block]:
    """The document's ``python`` fenced blocks, in order (indented ones, in list items,
    too)."""
    lines = (REPO / document).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence["lang"] == "python":
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            marker = _ILLUSTRATIVE.match(before)
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(document, i + 1, code, marker["why"] if marker else None))
        i = end + 1
    return blocks


@pytest.fixture
def orders(db: psycopg.Connection[Any], writer_url: str) -> None:
    """The application's own table the examples update: the owner creates it (tests/
    README.md, "Roles") and lets the writer role update it, as an app's migration would."""
    db.execute("CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL)")
    db.execute("INSERT INTO orders VALUES ('42', 'new')")
    db.execute(sql.SQL("GRANT SELECT, UPDATE ON orders TO {}").format(sql.Identifier(WRITER_ROLE)))


@pytest.fixture
def shortcuts_validate(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``relay.append`` and friends validate against schemas/, as the relay would."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("RELAY_SCHEMAS_DIR", str(REPO / "schemas"))
    default_outbox.cache_clear()  # built on first use: from this environment
    yield
    default_outbox.cache_clear()


def _rows(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.usefixtures("orders", "shortcuts_validate")
@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_python_blocks_of_the_docs_run(
    document: str, writer_url: str, db: psycopg.Connection[Any]
) -> None:
    blocks = python_blocks(document)
    runnable = [b for b in blocks if b.illustrative is None]
    assert runnable, f"{document}: no Python block runs"
    with psycopg.connect(writer_url, autocommit=True) as conn:
        given = {"conn": conn, "DATABASE_URL": writer_url, "log": logging.getLogger("docs")}
        namespace: dict[str, Any] = {"__name__": "docs"}
        for block in runnable:
            namespace.update(given)  # a block's own `with connect() as conn` ends with it
            where = f"{document}:{block.line}"
            exec(compile(block.code, where, "exec"), namespace)
    assert _rows(db) > 0, "the examples wrote no event"


def test_every_python_block_is_found_and_each_illustrative_one_says_why() -> None:
    """The reader itself: as many blocks as the documents open with ```python; and a page
    with a block that runs is one whose blocks run."""
    for document in PAGES:
        text = (REPO / document).read_text()
        blocks = python_blocks(document)
        assert len(blocks) == len(re.findall(r"^[ \t]*```python[ \t]*$", text, re.M))
        assert all(b.illustrative is None or b.illustrative.strip() for b in blocks)
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if "<!-- illustrative:" in line:  # bash blocks take it too (no test runs them)
                after = next((later for later in lines[i + 1 :] if later.strip()), "")
                assert _ILLUSTRATIVE.match(line) and _FENCE.match(after), (
                    f"{document}:{i + 1}: an illustrative marker that is not right before a block"
                )
        if any(b.illustrative is None for b in blocks):
            assert document in DOCUMENTS, f"{document}: a Python block no test runs"
