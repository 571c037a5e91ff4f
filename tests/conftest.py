"""Session fixtures that provide a real PostgreSQL and a real Apache Kafka.

Resolution order for both servers:

1. an external server named by ``OUTBOX_TEST_DATABASE_URL`` /
   ``OUTBOX_TEST_BOOTSTRAP_SERVERS``;
2. a testcontainers container (``postgres``, ``apache/kafka``), when a Docker engine
   answers;
3. a local process from :mod:`relay.localstack` (``initdb``/``postgres`` binaries, and
   Apache Kafka's pinned jars from Maven Central on a local JVM).

One broker serves the whole session; every test names its own topics (``topic_prefix``).
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
from relay.localstack import KAFKA_VERSION, LocalKafka, LocalPostgres, LocalServerError, free_port
from relay.localstack.kafka import wait_until_answers
from relay.outbox import Outbox
from relay.schemas import SchemaFolder
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


@dataclass(frozen=True)
class TestKafka:
    """The session's broker: its address, and the process when we started it here."""

    bootstrap_servers: str
    local: LocalKafka | None = None


def _apache_kafka_container() -> Any:
    """An ``apache/kafka`` container (KRaft, single node), advertised on a fixed host port."""
    from testcontainers.core.container import DockerContainer

    port = free_port()
    container = DockerContainer(f"apache/kafka:{KAFKA_VERSION}").with_bind_ports(9092, port)
    # The image takes either no KAFKA_* variables or a whole configuration: the latter,
    # as deploy/docker-compose.yml does.
    env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
    }
    for key, value in env.items():
        container = container.with_env(key, value)
    return container, port


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestKafka]:
    """The Apache Kafka broker shared by the session."""
    external = os.environ.get("OUTBOX_TEST_BOOTSTRAP_SERVERS")
    if external:
        yield TestKafka(external)
        return

    if docker_available():
        container, port = _apache_kafka_container()
        with container:
            bootstrap = f"127.0.0.1:{port}"
            wait_until_answers(bootstrap, timeout=90)
            yield TestKafka(bootstrap)
        return

    broker = LocalKafka(tmp_path_factory.mktemp("kafka"))
    with broker:
        _log.info("Apache Kafka for the tests started in %.1fs", broker.startup_seconds)
        yield TestKafka(broker.bootstrap_servers, broker)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka: TestKafka) -> str:
    """``bootstrap.servers`` of the session's broker."""
    return kafka.bootstrap_servers


@pytest.fixture
def local_kafka(kafka: TestKafka) -> LocalKafka:
    """The session's broker as a process we may kill and restart (chaos tests).

    A test that stops it must start it again before it ends: the session shares it.
    """
    if kafka.local is None:
        pytest.skip("the session's Kafka is external or a container: it cannot be killed here")
    return kafka.local


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


@pytest.fixture
def topic_prefix() -> str:
    """A unique topic-name prefix such as ``t1a2b3c4d.``; the broker is shared."""
    return f"t{uuid.uuid4().hex[:8]}."


# -- outbox-relay fixtures ---------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def registry() -> SchemaFolder:
    return SchemaFolder.from_dir(REPO / "schemas")


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to a fresh, migrated database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn)
        yield conn


@pytest.fixture
def outbox(registry: SchemaFolder) -> Outbox:
    return Outbox(registry)


@pytest.fixture
def start_relay(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, registry: SchemaFolder
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
    from spark_jobs.spark_session import local_spark_session

    session = local_spark_session("outbox-relay-tests")
    yield session
    session.stop()
