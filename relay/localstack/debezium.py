"""Debezium Server as a local process: the reference the relay's ``debezium`` format is
checked against (tests/acceptance/test_debezium_conformance.py), and the "running
Debezium" of the documented cut-over.

The distribution archive is pinned in ``debezium-server.lock``, fetched once into the
user's cache (checksum-verified, like every jar of the local stack) and unpacked beside
it. Each server gets a ``work_dir`` holding its ``config/application.properties``, its
offsets file and its log. Debezium Server 3.6 needs Java 21 or newer: ``JAVA_HOME``,
``java`` on PATH, or a JDK under /usr/lib/jvm, whichever is new enough.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg

from relay.adapters.postgres import db
from relay.artifacts.maven import Lock, fetch_lock
from relay.core.log_fields import log_extra
from relay.localstack.kafka import java_major
from relay.localstack.postgres import LocalPostgres
from relay.localstack.process import (
    LocalServer,
    LocalServerError,
    free_port,
    log_tail,
    reaper,
    signal_and_wait,
    spawn,
    write_private,
)

__all__ = [
    "DEBEZIUM_VERSION",
    "LocalDebeziumServer",
    "avro_converter_jars",
    "debezium_home",
    "postgres_to_kafka",
]

_log = logging.getLogger(__name__)

DEBEZIUM_VERSION = Lock.load("debezium-server").version_of("io.debezium", "debezium-server-dist")
MIN_JAVA = 21
_JVM_OPTIONS = (
    "-Xmx512m",
    "-XX:+ExitOnOutOfMemoryError",
    # Quarkus resets thread locals through java.lang internals (needed from Java 24 on).
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
)
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0


def debezium_home() -> Path:
    """The unpacked distribution (downloaded and unpacked on first use)."""
    (archive,) = fetch_lock("debezium-server")
    home = archive.parent / f"debezium-server-{DEBEZIUM_VERSION}"
    if (home / ".unpacked").exists():
        return home
    # Unpack beside, then rename: a half-unpacked tree is never taken for a whole one.
    staging = Path(tempfile.mkdtemp(dir=archive.parent, prefix=".unpack-"))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        (staging / "debezium-server" / ".unpacked").touch()
        shutil.rmtree(home, ignore_errors=True)
        (staging / "debezium-server").rename(home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return home


def avro_converter_jars() -> list[Path]:
    """What Debezium Server's ``avro`` format (Apicurio's AvroConverter, which the
    distribution bundles) needs and the distribution lacks: Apache Avro itself, at the
    version that Apicurio release builds with (``debezium-avro.lock``)."""
    return fetch_lock("debezium-avro")


def find_java21() -> str:
    """A ``java`` of version 21 or newer; a clear error otherwise."""
    candidates = []
    if home := os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(home) / "bin" / "java"))
    if on_path := shutil.which("java"):
        candidates.append(on_path)
    candidates += sorted(str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java"))
    for java in candidates:
        if Path(java).exists() and java_major(java) >= MIN_JAVA:
            return java
    raise LocalServerError(
        f"Debezium Server {DEBEZIUM_VERSION} needs Java {MIN_JAVA} or newer; none among "
        f"{candidates or ['(no java found)']}. Install one (e.g. a Temurin 21 JDK) or set "
        "JAVA_HOME to it"
    )


def postgres_to_kafka(postgres: LocalPostgres, dbname: str, bootstrap: str) -> dict[str, str]:
    """Properties for the PostgreSQL connector on ``dbname`` of ``postgres`` (pgoutput,
    slot and publication ``dbz_<dbname>``, the publication of the captured tables only, no
    snapshot of existing rows, topic prefix ``dbz``) and the Kafka sink with string keys
    and values. Add the tables, transforms and formats."""
    string = "org.apache.kafka.common.serialization.StringSerializer"
    return {
        "debezium.sink.type": "kafka",
        "debezium.sink.kafka.producer.bootstrap.servers": bootstrap,
        "debezium.sink.kafka.producer.key.serializer": string,
        "debezium.sink.kafka.producer.value.serializer": string,
        "debezium.source.connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "debezium.source.database.hostname": "127.0.0.1",
        "debezium.source.database.port": str(postgres.port),
        "debezium.source.database.user": "postgres",
        "debezium.source.database.password": postgres.password,
        "debezium.source.database.dbname": dbname,
        "debezium.source.topic.prefix": "dbz",
        "debezium.source.plugin.name": "pgoutput",
        "debezium.source.slot.name": f"dbz_{dbname}",
        "debezium.source.publication.name": f"dbz_{dbname}",
        "debezium.source.publication.autocreate.mode": "filtered",
        "debezium.source.snapshot.mode": "no_data",
    }


class LocalDebeziumServer(LocalServer):
    """Debezium Server with the given ``debezium.*`` properties, on 127.0.0.1."""

    def __init__(
        self,
        work_dir: Path,
        properties: Mapping[str, str],
        jvm_options: Sequence[str] = (),
        extra_jars: Sequence[Path] = (),
    ) -> None:
        self.work_dir = Path(work_dir).absolute()
        self.properties = dict(properties)
        # Jars the distribution lacks, e.g. avro_converter_jars() for format "avro".
        self.extra_jars = tuple(Path(j) for j in extra_jars)
        # After the defaults: a later -Xmx (or any repeated option) wins.
        self.jvm_options = tuple(jvm_options)
        self.log_path = self.work_dir / "debezium.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"LocalDebeziumServer(work_dir={str(self.work_dir)!r})"

    def start(self) -> None:
        """Start the server; returns once its JVM runs (see :meth:`wait_streaming`)."""
        if self.running:
            return
        java = find_java21()
        home = debezium_home()
        config = self.work_dir / "config"
        config.mkdir(mode=0o700, parents=True, exist_ok=True)
        settings = {
            "quarkus.http.port": str(free_port()),
            "quarkus.log.console.json": "false",
            "debezium.source.offset.storage.file.filename": str(self.work_dir / "offsets.dat"),
            **self.properties,
        }
        # It holds the database password.
        write_private(
            config / "application.properties",
            "".join(f"{name}={_escape(value)}\n" for name, value in settings.items()),
        )
        (runner,) = home.glob("debezium-server-*runner.jar")
        classpath = os.pathsep.join(
            [
                str(runner),
                str(home / "config" / "lib"),
                str(home / "lib" / "*"),
                *map(str, self.extra_jars),
            ]
        )
        argv = [java, *_JVM_OPTIONS, *self.jvm_options, "-cp", classpath, "io.debezium.server.Main"]
        _log.info(
            "starting Debezium Server %s in %s",
            DEBEZIUM_VERSION,
            self.work_dir,
            extra=log_extra("local_debezium_starting", version=DEBEZIUM_VERSION),
        )
        with self.log_path.open("ab") as out:
            self._proc = spawn(argv, out, cwd=self.work_dir)
        reaper.add(self)

    def wait_streaming(self, database_url: str, timeout: float = _START_TIMEOUT_S) -> None:
        """Wait until the connector streams from its replication slot."""
        slot = self.properties.get("debezium.source.slot.name", "debezium")
        deadline = time.monotonic() + timeout
        with db.connect(database_url, application_name="outbox-relay-local") as conn:
            while not _slot_active(conn, slot):
                if self._proc is None or self._proc.poll() is not None:
                    raise LocalServerError(
                        f"Debezium Server exited before streaming; its log:\n{log_tail(self.log_path)}"
                    )
                if time.monotonic() > deadline:
                    raise LocalServerError(
                        f"Debezium Server did not stream within {timeout:.0f}s; its log:\n"
                        f"{log_tail(self.log_path)}"
                    )
                time.sleep(0.2)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Graceful stop (SIGTERM): it flushes what it read and records its offset."""
        if self._proc is not None:
            signal_and_wait(self._proc, signal.SIGTERM, timeout, "debezium-server")
            self._proc = None
        reaper.discard(self)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def _escape(value: str) -> str:
    """A value as application.properties must spell it: backslashes doubled, and ``${``
    escaped, or Quarkus expands it (the router's ``${routedByValue}`` is literal)."""
    return value.replace("\\", "\\\\").replace("${", "\\\\${")


def _slot_active(conn: psycopg.Connection[Any], slot: str) -> bool:
    row = conn.execute(
        "SELECT active FROM pg_catalog.pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    return bool(row and row[0])
