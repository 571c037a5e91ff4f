"""``outbox-relay local``: the local Postgres and Apache Kafka for your own app.

The same servers ``./dev.sh demo`` runs, without the demo writer: a database with the
outbox migrated, and a broker, until Ctrl-C or SIGTERM; with ``registry``, the schema
registry the tests use too (Apicurio, relay/localstack/registry.py). It prints the
settings to export, so ``outbox-relay run`` and an app can use them from another
terminal.
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from psycopg import sql

from relay.adapters.postgres import db, migrations
from relay.core.log_fields import log_extra
from relay.localstack.kafka import KAFKA_VERSION, LocalKafka
from relay.localstack.postgres import LocalPostgres
from relay.localstack.process import LocalServer, LocalServerError

__all__ = ["migrated_database", "run_local"]

logger = logging.getLogger(__name__)

# How often the servers are looked at while the stack runs.
_WATCH_S = 1.0


def run_local(
    *,
    workdir: Path,
    database: str,
    postgres_port: int | None,
    kafka_port: int | None,
    registry: bool = False,
) -> None:
    """Start the servers in ``workdir``, migrate ``database``, wait for a stop signal."""
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ExitStack() as stack:
            postgres = stack.enter_context(LocalPostgres(workdir / "pg", port=postgres_port))
            kafka = stack.enter_context(LocalKafka(workdir / "kafka", port=kafka_port))
            url = migrated_database(postgres, database, application_name="outbox-relay-local")
            servers: dict[str, LocalServer] = {"Postgres": postgres, "Apache Kafka": kafka}
            registry_url = _started_registry(stack, workdir, servers) if registry else None
            sys.stdout.write(
                f"Postgres {postgres.data_dir} and Apache Kafka {KAFKA_VERSION} "
                f"(started in {kafka.startup_seconds or 0:.1f} s) are running"
                f"{'' if registry_url is None else ', and a schema registry'}. Use:\n"
                f"export RELAY_DATABASE_URL={shlex.quote(url)}\n"
                f"export RELAY_BOOTSTRAP_SERVERS={shlex.quote(kafka.bootstrap_servers)}\n"
                + (
                    ""
                    if registry_url is None
                    else f"export RELAY_SCHEMA_REGISTRY_URL={shlex.quote(registry_url)}\n"
                )
                + f"The URL's password is in {postgres.passfile} (yours alone to read).\n"
                "Ctrl-C stops them; the data of Postgres and Kafka stays in "
                f"{workdir}.\n"
            )
            sys.stdout.flush()
            while not stopping.wait(_WATCH_S):
                _check_running(servers)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_running(servers: dict[str, LocalServer]) -> None:
    """A server that stopped by itself (killed, out of memory, its disk full) ends the
    stack with its name and log, rather than leave the app and the relay facing a
    dead port."""
    for name, server in servers.items():
        if not server.running:
            raise LocalServerError(
                f"{name} stopped by itself (its log: {server.log_path}); stopping the others"
            )


def _started_registry(stack: ExitStack, workdir: Path, servers: dict[str, LocalServer]) -> str:
    """The schema registry, started in ``workdir`` (built once, minutes, with Maven: its
    progress goes to stderr); its Confluent-compatible URL. It keeps nothing across
    restarts (storage in memory)."""
    from relay.localstack.registry import LocalRegistry

    sys.stderr.write("starting the schema registry (its first start builds it: minutes)\n")
    sys.stderr.flush()
    registry = stack.enter_context(LocalRegistry(workdir / "registry"))
    servers["the schema registry"] = registry
    return registry.ccompat_url


def migrated_database(postgres: LocalPostgres, name: str, *, application_name: str) -> str:
    """Database ``name`` on ``postgres``, created if missing and migrated; its URL."""
    with db.connect(postgres.url, application_name=application_name) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if found.fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            logger.info(
                "created database %s",
                name,
                extra=log_extra("local_database_created", database=name),
            )
    url = postgres.url_for(name)
    with db.connect(url, application_name=application_name) as conn:
        migrations.migrate(conn)
    return url
