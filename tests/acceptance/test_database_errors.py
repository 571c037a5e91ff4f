"""Issue #28: permanent database errors are said to be permanent, with their fix, and
end the command instead of being retried for ever; `migrate` and `run --migrate` wait
for a Postgres that is down, as `run` does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.localstack import LocalPostgres, free_port
from tests.plugins.postgres import PgServer
from tests.support import REPO, login_url, run_cli

_REFUSED = r"does not exist|password authentication failed|no password supplied"


def test_an_unknown_database_is_permanent_and_run_exits(pg_server: PgServer) -> None:
    url = pg_server.url_for(f"missing_{uuid.uuid4().hex[:8]}")
    env = {"RELAY_DATABASE_URL": url, "RELAY_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    for args in (("run",), ("migrate",), ("status",)):
        result = run_cli(*args, env={**env, "RELAY_METRICS_ENABLED": "false"}, timeout=60)
        assert result.returncode == 1, result.stderr
        assert "permanent" in result.stderr and "does not exist" in result.stderr
        assert "create the database" in result.stderr and "Traceback" not in result.stderr


def test_a_refused_login_is_permanent_and_names_the_fix(pg_server: PgServer) -> None:
    """Issue #28: a login the server refuses (here an unknown role, with a password and
    without; a bad password and a missing pg_hba.conf entry read alike) has no SQLSTATE,
    and was retried for ever as an unreachable server. A server that trusts the login
    says the role does not exist; one that checks passwords (issue #47: the local one),
    that the password failed, or libpq that the URL gives none."""
    nobody = f"nobody_{uuid.uuid4().hex[:8]}"
    for password in ("wrong", None):
        url = psycopg.conninfo.make_conninfo(pg_server.url, user=nobody, password=password)
        env = {"RELAY_DATABASE_URL": url, "RELAY_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
        for args in (("status",), ("migrate",), ("run",)):
            result = run_cli(*args, env={**env, "RELAY_METRICS_ENABLED": "false"}, timeout=60)
            assert result.returncode == 1, result.stderr
            assert "permanent" in result.stderr and "fix the user or password" in result.stderr
            assert re.search(_REFUSED, result.stderr) and "Traceback" not in result.stderr


def test_missing_grants_are_permanent_and_name_the_grant_command(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    role = f"nogrant_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        url = login_url(database_url, role)
        assert info.get("user") != role
        env = {
            "RELAY_DATABASE_URL": url,
            "RELAY_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "RELAY_METRICS_ENABLED": "false",
        }
        result = run_cli("run", env=env, timeout=60)
        assert result.returncode == 1, result.stderr
        assert "permanent" in result.stderr and "outbox-relay grant --relay-role" in result.stderr
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def later_postgres() -> Iterator[LocalPostgres]:
    """A Postgres not started yet (the test starts it); as root it runs as `postgres`,
    which cannot enter pytest's tmp_path."""
    base = Path(tempfile.mkdtemp(prefix="outbox-later-pg-"))
    base.chmod(0o755)
    server = LocalPostgres(base / "pg", port=free_port(), fsync=False)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("args", [("migrate",), ("run", "--migrate")], ids=["migrate", "run"])
def test_migrate_waits_for_postgres_as_run_does(
    later_postgres: LocalPostgres, args: tuple[str, ...]
) -> None:
    env = {
        "RELAY_DATABASE_URL": later_postgres.url,
        "RELAY_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "RELAY_METRICS_ENABLED": "false",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", *args],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        waiting = threading.Event()
        lines: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if "waiting for Postgres" in line:
                    waiting.set()

        threading.Thread(target=read, daemon=True).start()
        assert waiting.wait(60), "".join(lines)
        later_postgres.start()
        # migrate finishes; run --migrate goes on to wait for the broker (not a fault).
        if args == ("migrate",):
            assert proc.wait(120) == 0, "".join(lines)
        with psycopg.connect(later_postgres.url, autocommit=True) as conn:
            for _ in range(1200):
                [[migrated]] = conn.execute("SELECT to_regclass('public.outbox') IS NOT NULL")
                if migrated:
                    break
                threading.Event().wait(0.1)
            assert migrated, "".join(lines)
    finally:
        proc.terminate()
        proc.wait(30)
