"""Issue #28, item 4: `outbox-relay local --postgres-port P` with P taken by another
Postgres used to report "postgres ready" for its own server, which had died, and print
the other server's URL to export. It now fails naming the port, and prints nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.plugins.postgres import PgServer
from tests.support import local_workdir, run_cli


@pytest.fixture
def workdir() -> Iterator[Path]:
    with local_workdir("outbox-local-port-", "local") as folder:
        yield folder


def test_a_postgres_port_in_use_is_named_and_nothing_is_exported(
    pg_server: PgServer, workdir: Path
) -> None:
    info = psycopg.conninfo.conninfo_to_dict(pg_server.url)
    if info.get("host") not in ("127.0.0.1", "localhost") or not info.get("port"):
        pytest.skip("needs the test Postgres on this host")
    port = str(info["port"])
    result = run_cli("local", "--workdir", str(workdir), "--postgres-port", port, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "export" not in result.stdout and "Traceback" not in result.stderr
