"""Real PostgreSQL servers for the tests: the session's shared server (``pg_server``),
a fresh database per test (``database_url``), and clusters of a test's own.

Resolution order for the shared server: an external one named by
``OUTBOX_TEST_DATABASE_URL``; a testcontainers ``postgres`` container when a Docker
engine answers; a local process from :mod:`relay.localstack` (``initdb``/``postgres``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.localstack import LocalPostgres, LocalServerError
from tests.plugins.containers import docker_available


class PgServer(Protocol):
    """What ``pg_server`` yields: an admin URL and URLs of other databases."""

    @property
    def url(self) -> str: ...

    def url_for(self, dbname: str) -> str: ...


def _with_dbname(url: str, dbname: str) -> str:
    """``url`` pointing at database ``dbname`` instead (URL or key=value conninfo)."""
    if url.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(url)
        return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))
    return make_conninfo(url, dbname=dbname)


@dataclass(frozen=True)
class UrlPostgres:
    """A server we did not start (external, or a container): known only by its URL."""

    url: str

    def url_for(self, dbname: str) -> str:
        return _with_dbname(self.url, dbname)


def _new_local_postgres(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    fsync: bool,
    settings: dict[str, str] | None = None,
) -> tuple[LocalPostgres, Path | None]:
    """A (not yet started) LocalPostgres, plus a directory to delete afterwards.

    As root, postgres runs as the ``postgres`` user, which cannot enter pytest's 0700
    temp tree; the data directory then goes into its own ``mkdtemp`` (chowned to
    ``postgres`` by LocalPostgres) while the log stays in pytest's temp tree.
    """
    base = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:
        data_dir = Path(tempfile.mkdtemp(prefix="outbox-test-pg-"))
        data = data_dir
    else:
        data, data_dir = base / "data", None
    server = LocalPostgres(data, fsync=fsync, log_path=base / "postgres.log", settings=settings)
    return server, data_dir


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgServer]:
    """A PostgreSQL server shared by the session; ``.url`` is a superuser admin URL."""
    external = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if external:
        yield UrlPostgres(external)
        return

    if docker_available():
        try:
            from testcontainers.community.postgres import (
                PostgresContainer,
            )
        except ImportError:  # testcontainers < 4.10
            from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            url = container.get_connection_url()
            yield UrlPostgres(_with_dbname(url, "postgres"))
        return

    server, cleanup = _new_local_postgres(tmp_path_factory, fsync=False)
    try:
        with server:
            yield server
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


@pytest.fixture
def local_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A started LocalPostgres of the test's own, safe to restart()/stop() (fsync on)."""
    yield from _started(*_new_local_postgres(tmp_path_factory, fsync=True))


@pytest.fixture
def logical_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A started LocalPostgres of the test's own with wal_level=logical (Debezium)."""
    server = _new_local_postgres(tmp_path_factory, fsync=False, settings={"wal_level": "logical"})
    yield from _started(*server)


def _started(server: LocalPostgres, cleanup: Path | None) -> Iterator[LocalPostgres]:
    try:
        try:
            server.start()
        except LocalServerError as exc:
            pytest.skip(f"cannot start a local PostgreSQL server: {exc}")
        yield server
    finally:
        server.stop()
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


@pytest.fixture
def new_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], LocalPostgres]]:
    """Start fresh PostgreSQL clusters of the test's own (a restore target, a replica's
    primary...); each is stopped and deleted at teardown."""
    made: list[tuple[LocalPostgres, Path | None]] = []

    def make() -> LocalPostgres:
        server, cleanup = _new_local_postgres(tmp_path_factory, fsync=False)
        made.append((server, cleanup))
        try:
            server.start()
        except LocalServerError as exc:
            pytest.skip(f"cannot start a local PostgreSQL server: {exc}")
        return server

    yield make
    for server, cleanup in made:
        server.stop()
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


@pytest.fixture
def database_url(pg_server: PgServer) -> Iterator[str]:
    """URL of a fresh, empty database on ``pg_server``; dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    ident = sql.Identifier(name)
    with psycopg.connect(pg_server.url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    try:
        yield pg_server.url_for(name)
    finally:
        with psycopg.connect(pg_server.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
