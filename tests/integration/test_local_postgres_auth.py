"""Issue #47, low: the local stack's Postgres (`outbox-relay local`, `./dev.sh demo`, the
test servers) trusted every login on 127.0.0.1, so any user of the machine could run SQL
on it as the superuser. Now a TCP login needs the cluster's password, kept in a file only
the stack's user can read, and the trusted Unix socket is in a directory only that user
can enter."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from relay.localstack import LocalPostgres
from relay.localstack.postgres import find_pg_binary

OTHER_USER = "nobody"


def _without_password_file(url: str) -> str:
    """``url`` as another user would write it: the same server, no password file."""
    return urlunsplit(urlsplit(url)._replace(query=""))


def _refused(conninfo: str) -> str:
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(conninfo, connect_timeout=10).close()
    return str(refused.value)


def test_a_tcp_login_needs_the_clusters_password(local_postgres: LocalPostgres) -> None:
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:  # the stack's own
        conn.execute(sql.SQL("CREATE ROLE app_no_password LOGIN"))
    bare = _without_password_file(local_postgres.url)
    assert "no password supplied" in _refused(bare)
    assert "password authentication failed" in _refused(f"{bare}?password=guess")
    # A role left without a password (as `grant --create` leaves one) cannot log in.
    other_role = bare.replace("postgres@", "app_no_password@", 1)
    assert "no password supplied" in _refused(other_role)
    assert "password authentication failed" in _refused(f"{other_role}?password=guess")
    # The password is in the URL's file, not in the URL.
    assert local_postgres.password not in local_postgres.url
    assert stat.S_IMODE(local_postgres.passfile.stat().st_mode) == 0o600
    # The trusted socket is in the data directory, which only its owner may enter.
    assert stat.S_IMODE(local_postgres.data_dir.stat().st_mode) == 0o700


def _as_other_user(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # the exit code is the verdict
        argv,
        user=OTHER_USER,
        group=pwd.getpwnam(OTHER_USER).pw_gid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PGCONNECT_TIMEOUT": "10"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_another_user_of_the_machine_cannot_log_in(local_postgres: LocalPostgres) -> None:
    """As another OS user: psql over TCP (no password to give) and over the socket (its
    directory is closed), and reading the password file, all fail."""
    if os.geteuid() != 0:
        pytest.skip("switching to another OS user needs root (the test above covers TCP)")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        pytest.skip(f"no {OTHER_USER!r} user to log in as")
    psql = find_pg_binary("psql")
    query = ("-X", "-w", "-U", "postgres", "-d", "postgres", "-c", "SELECT 1")
    tcp = _as_other_user(psql, "-h", "127.0.0.1", "-p", str(local_postgres.port), *query)
    assert tcp.returncode != 0 and "no password supplied" in tcp.stderr, tcp.stderr
    socket_dir = str(local_postgres.data_dir)
    socket = _as_other_user(psql, "-h", socket_dir, "-p", str(local_postgres.port), *query)
    assert socket.returncode != 0 and "Permission denied" in socket.stderr, socket.stderr
    read = _as_other_user("cat", str(local_postgres.passfile))
    assert read.returncode != 0 and "Permission denied" in read.stderr, read.stderr


def test_a_cluster_made_when_logins_were_trusted_gets_a_password(
    local_postgres: LocalPostgres,
) -> None:
    """A data directory from before issue #47 (no password file, no password, trust in
    pg_hba.conf): the next start sets a password and stops trusting TCP, data kept."""
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)")
        conn.execute("ALTER ROLE postgres PASSWORD NULL")
    local_postgres.stop()
    local_postgres.passfile.unlink()
    hba = local_postgres.data_dir / "pg_hba.conf"
    hba.write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
    local_postgres.start()
    assert "no password supplied" in _refused(_without_password_file(local_postgres.url))
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        assert conn.execute("SELECT n FROM kept").fetchall() == [(1,)]
    host_lines = [line.split() for line in hba.read_text().splitlines() if line.startswith("host")]
    assert host_lines and all(line[-1] == "scram-sha-256" for line in host_lines)
