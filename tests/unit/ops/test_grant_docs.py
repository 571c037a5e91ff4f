"""deploy/README lists what `outbox-relay grant` runs: an operator granting by hand
(or auditing a database) reads that listing, so a statement missing from it is a
privilege missing in their database (the writer's sequence grant was)."""

from __future__ import annotations

import re
from pathlib import Path

from relay.adapters.postgres.queries import parse_named, read_sql

REPO = Path(__file__).resolve().parents[3]
ROLES = {"relay_grants": "outbox_relay", "relay_no_read_all_stats": "outbox_relay"}
ROLES["writer_grants"] = "app_writer"


def _statements(text: str) -> set[str]:
    """GRANT/REVOKE statements, comments dropped and whitespace collapsed."""
    code = re.sub(r"--[^\n]*", "", text)
    return {
        " ".join(s.split()) for s in code.split(";") if s.split()[:1] in (["GRANT"], ["REVOKE"])
    }


def _readme_listing() -> set[str]:
    readme = (REPO / "deploy" / "README.md").read_text()
    start = readme.index("For `schema = public`, that is:")
    block = readme[start:].split("```sql", 1)[1].split("```", 1)[0]
    return _statements(block)


def test_the_deploy_readme_lists_every_statement_grant_runs() -> None:
    blocks = parse_named(read_sql("roles.sql"))
    listed = _readme_listing()
    for name, role in ROLES.items():
        for statement in _statements(blocks[name]):
            expected = statement.format(schema="public", role=role)
            assert expected in listed, f"deploy/README.md lacks: {expected}"


def test_the_deploy_readme_shows_the_row_security_grant_sets_up() -> None:
    """`grant --aggregate-types order,invoice` for app_writer, as the README lists it."""
    blocks = parse_named(read_sql("roles.sql"))
    readme = (REPO / "deploy" / "README.md").read_text()
    start = readme.index("**`--aggregate-types a,b`**")
    listed = readme[start:].split("```sql", 1)[1].split("```", 1)[0]
    names = {"schema": "public", "role": "app_writer", "types": "'{order,invoice}'"}
    names["policy"] = '"aggregate types of app_writer"'
    run = [blocks[b] for b in ("rows_policy", "enable_row_security", "writer_types_policy")]

    def statements(text: str) -> list[str]:
        code = re.sub(r"--[^\n]*", "", text)
        return [" ".join(s.split()) for s in code.split(";") if s.split()]

    assert statements(listed) == [s.format(**names) for b in run for s in statements(b)]


def test_grant_runs_each_statement_once() -> None:
    blocks = parse_named(read_sql("roles.sql"))
    for name in ROLES:
        code = re.sub(r"--[^\n]*", "", blocks[name])
        statements = [" ".join(s.split()) for s in code.split(";") if s.strip()]
        assert len(statements) == len(set(statements)), name
