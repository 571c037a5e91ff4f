"""Apache Kafka on 127.0.0.1 (KRaft: broker and controller in one JVM per node): a single
node (:class:`LocalKafka`), or several forming one cluster (:class:`LocalKafkaCluster`).

The broker's jars are the pinned set in ``kafka.lock`` (see :mod:`relay.artifacts.maven`),
fetched once into the user's cache. Everything else lives in ``work_dir``:

* ``server.properties``: written on the first start, with two free ports (client and
  controller), then kept, so a restart comes back on the same address;
* ``data/``: the log, formatted once (``kafka-storage format``); a restart, even after
  ``kill -9``, finds every committed record there;
* ``log4j2.properties`` and the broker's own log (``broker.log`` unless given).

With ``scram_users`` the broker also listens for SASL_PLAINTEXT clients
(``sasl_bootstrap_servers``) authenticated with SCRAM-SHA-256 as those users, whose
credentials are written when the log is formatted.

Java 17 or newer is required (``JAVA_HOME``, else ``java`` on PATH).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.artifacts.maven import Lock, fetch_lock
from relay.core.log_fields import log_extra
from relay.localstack.process import (
    LocalServer,
    LocalServerError,
    free_port,
    log_tail,
    port_open,
    reaper,
    signal_and_wait,
    spawn,
)

__all__ = [
    "KAFKA_VERSION",
    "KraftNode",
    "LocalKafka",
    "LocalKafkaCluster",
    "find_java",
    "java_major",
    "wait_until_answers",
]

_log = logging.getLogger(__name__)

KAFKA_VERSION = Lock.load("kafka").version_of("org.apache.kafka", "kafka_2.13")
MIN_JAVA = 17
_START_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 30.0
_JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx1g",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

# A development broker: one replica of everything, no auto-created topics (the relay
# creates its own, like a production cluster would require), small internal topics so a
# fresh broker answers its first group and transaction requests quickly.
_DEFAULTS = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "num.partitions": "3",
    "auto.create.topics.enable": "false",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "10",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "10",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # After a kill -9 the restarted broker must wait out its old registration: keep short.
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "3000",
}


def cluster_defaults(nodes: int) -> dict[str, str]:
    """Broker settings for a cluster of ``nodes``: what deploy/README.md recommends for
    production (replication factor 3, min.insync.replicas 2, the transaction state log
    likewise, no unclean leader election), scaled down when there are fewer nodes."""
    replicas = min(3, nodes)
    min_isr = str(max(1, replicas - 1))
    return {
        "default.replication.factor": str(replicas),
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": min_isr,
        "unclean.leader.election.enable": "false",
    }


@dataclass(frozen=True)
class KraftNode:
    """One node's place in a multi-node KRaft quorum (see :class:`LocalKafkaCluster`)."""

    node_id: int
    controller_port: int
    #: ``controller.quorum.voters`` of the whole quorum, the same on every node.
    voters: str
    #: Every node's log directory is formatted with the same cluster id.
    cluster_id: str


_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""


def find_java() -> tuple[str, int]:
    """The ``java`` to run Kafka with, and its major version; a clear error otherwise."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        raise LocalServerError(
            f"no Java found ({'JAVA_HOME=' + home if home else 'no java on PATH'}): the local "
            f"Apache Kafka needs Java {MIN_JAVA} or newer. Install one (for example "
            "apt-get install openjdk-17-jre-headless) or set JAVA_HOME; or point at a Kafka "
            "you already run with --bootstrap-servers"
        )
    major = java_major(java)
    if major < MIN_JAVA:
        raise LocalServerError(
            f"{java} is Java {major}; Apache Kafka {KAFKA_VERSION} needs Java {MIN_JAVA} or "
            "newer. Install one, or set JAVA_HOME to it"
        )
    return java, major


def java_major(java: str) -> int:
    """The major version of the ``java`` executable at ``java``."""
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        raise LocalServerError(f"cannot tell the version of {java}: {out.stderr.strip()!r}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0" is Java 8
        major = int(match.group(2))
    return major


class LocalKafka(LocalServer):
    """Apache Kafka on 127.0.0.1, its data and configuration kept in ``work_dir``."""

    def __init__(
        self,
        work_dir: Path,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        config: Mapping[str, str] | None = None,
        node: KraftNode | None = None,
        scram_users: Mapping[str, str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir).absolute()
        self._scram_users = dict(scram_users or {})
        self.sasl_port = 0
        self.log_path = Path(log_path) if log_path else self.work_dir / "broker.log"
        self._wanted_port = port
        self._extra = dict(config or {})
        self._node = node
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        #: Seconds from spawning the JVM to the broker answering metadata requests.
        self.startup_seconds: float | None = None
        self._launched = 0.0

    def __repr__(self) -> str:
        return f"LocalKafka(work_dir={str(self.work_dir)!r}, port={self.port})"

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def node_id(self) -> int:
        return self._node.node_id if self._node is not None else 1

    @property
    def sasl_bootstrap_servers(self) -> str:
        """The SASL_PLAINTEXT (SCRAM-SHA-256) listener's address, with ``scram_users``."""
        if not self.sasl_port:
            raise LocalServerError("this local Kafka has no SASL listener (no scram_users)")
        return f"127.0.0.1:{self.sasl_port}"

    def start(self) -> None:
        """Start the broker (formatting ``work_dir`` the first time); wait until it answers."""
        if self.running:
            return
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Spawn the JVM without waiting for it: the nodes of a cluster answer only once
        a majority of them runs, so a cluster launches them all, then waits."""
        if self.running:
            return
        java, _ = find_java()
        jars = fetch_lock("kafka")
        properties = self._configure()
        classpath = os.pathsep.join(str(j) for j in jars)
        self._check_ports_free()
        self._format(java, classpath, properties)
        argv = [
            java,
            *_JVM_OPTIONS,
            f"-Dlog4j2.configurationFile={self.work_dir / 'log4j2.properties'}",
            "-cp", classpath,
            "kafka.Kafka", str(properties),
        ]  # fmt: skip
        _log.info(
            "starting Apache Kafka %s on %s",
            KAFKA_VERSION,
            self.bootstrap_servers,
            extra=log_extra("local_kafka_starting", version=KAFKA_VERSION),
        )
        self._launched = time.monotonic()
        with (self.work_dir / "stdout.log").open("ab") as out:
            self._proc = spawn(argv, out, cwd=self.work_dir)
        reaper.add(self)

    def wait_ready(self) -> None:
        """Wait until the launched broker answers metadata requests (killed if it fails)."""
        assert self._proc is not None, "launch() first"
        try:
            self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.startup_seconds = time.monotonic() - self._launched
        _log.info(
            "Apache Kafka ready on %s in %.1fs (pid %s)",
            self.bootstrap_servers,
            self.startup_seconds,
            self._proc.pid,
            extra=log_extra("local_kafka_ready", startup_seconds=self.startup_seconds),
        )

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Controlled shutdown (SIGTERM); SIGKILL after ``timeout``. The data stays."""
        if self._proc is not None:
            if self._proc.poll() is None:
                with_sigcont(self._proc)
            signal_and_wait(self._proc, signal.SIGTERM, timeout, "kafka")
            self._proc = None
        reaper.discard(self)

    def request_stop(self) -> None:
        """Begin a controlled shutdown (SIGTERM) without waiting for it: :meth:`stop` waits."""
        if self._proc is not None and self._proc.poll() is None:
            with_sigcont(self._proc)
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    # -- internals

    def _configure(self) -> Path:
        """``server.properties``: kept from an earlier start, else written with free ports."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / "server.properties"
        (self.work_dir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log_path))
        if path.exists():
            listeners = _read_properties(path)["listeners"]
            self.port = int(re.search(r"(?<!_)PLAINTEXT://[^:]+:(\d+)", listeners).group(1))  # type: ignore[union-attr]
            sasl = re.search(r"SASL_PLAINTEXT://[^:]+:(\d+)", listeners)
            self.sasl_port = int(sasl.group(1)) if sasl else 0
            return path
        self.port = self._wanted_port or free_port()
        node = self._node
        controller = node.controller_port if node is not None else free_port()
        settings = {
            **_DEFAULTS,
            **self._quorum(controller),
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "log.dirs": str(self.work_dir / "data"),
        }
        settings.update(self._sasl_listener(settings["listeners"]))
        settings.update(self._extra)
        path.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        return path

    def _quorum(self, controller_port: int) -> dict[str, str]:
        """This node's id and the controller quorum: itself alone, or the cluster's."""
        if self._node is None:
            return {"node.id": "1", "controller.quorum.voters": f"1@127.0.0.1:{controller_port}"}
        return {"node.id": str(self._node.node_id), "controller.quorum.voters": self._node.voters}

    def _sasl_listener(self, listeners: str) -> dict[str, str]:
        """With ``scram_users``: a SASL_PLAINTEXT listener next to PLAINTEXT."""
        if not self._scram_users:
            return {}
        self.sasl_port = free_port()
        sasl = f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}"
        return {
            "listeners": f"{listeners},{sasl}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port},{sasl}",
            "listener.security.protocol.map": (
                "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
            ),
            "sasl.enabled.mechanisms": "SCRAM-SHA-256",
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
        }

    def _format(self, java: str, classpath: str, properties: Path) -> None:
        if (self.work_dir / "data" / "meta.properties").exists():
            return
        cluster_id = self._node.cluster_id if self._node is not None else _cluster_id()
        argv = [java, "-cp", classpath, "kafka.tools.StorageTool", "format",
                "-t", cluster_id, "-c", str(properties)]  # fmt: skip
        for user, password in self._scram_users.items():
            argv += ["--add-scram", f"SCRAM-SHA-256=[name={user},password={password}]"]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            raise LocalServerError(
                f"formatting Kafka's log directory failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )

    def _check_ports_free(self) -> None:
        listeners = _read_properties(self.work_dir / "server.properties")["listeners"]
        for port in re.findall(r":(\d+)", listeners):
            if port_open(int(port), timeout=0.2):
                raise LocalServerError(
                    f"port {port} on 127.0.0.1 is in use, so the local Kafka in "
                    f"{self.work_dir} cannot listen there. Stop whatever holds it, or "
                    "delete that folder's server.properties to pick new ports"
                )

    def _wait_ready(self) -> None:
        def exited() -> str | None:
            assert self._proc is not None
            rc = self._proc.poll()
            if rc is None:
                return None
            return (
                f"Kafka exited with code {rc} during start-up; log {self.log_path}:\n"
                f"{log_tail(self.log_path)}\n{log_tail(self.work_dir / 'stdout.log')}"
            )

        wait_until_answers(self.bootstrap_servers, _START_TIMEOUT_S, exited)

    def _kill(self) -> None:
        if self._proc is not None:
            signal_and_wait(self._proc, signal.SIGKILL, 5.0, "kafka")
            self._proc = None
        reaper.discard(self)

    def kill(self) -> None:
        """``kill -9`` the broker and reap it (its data stays: :meth:`start` again)."""
        self._kill()


class LocalKafkaCluster:
    """``nodes`` Apache Kafka nodes on 127.0.0.1, each broker and controller, one KRaft
    quorum, in ``work_dir/node-N``. Settings default to :func:`cluster_defaults`
    (replication factor 3, min.insync.replicas 2); ``config`` adds to them.

    Nodes may be killed and restarted one by one (``nodes[i].kill()``, ``.start()``): each
    keeps its ports and data. The quorum needs a majority of the nodes running.
    """

    def __init__(
        self, work_dir: Path, *, nodes: int = 3, config: Mapping[str, str] | None = None
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, not {nodes}")
        self.work_dir = Path(work_dir).absolute()
        controllers = [free_port() for _ in range(nodes)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{port}" for i, port in enumerate(controllers))
        cluster_id = _cluster_id()
        settings = {**cluster_defaults(nodes), **(config or {})}
        self.nodes = [
            LocalKafka(
                self.work_dir / f"node-{i + 1}",
                config=settings,
                node=KraftNode(i + 1, port, voters, cluster_id),
            )
            for i, port in enumerate(controllers)
        ]

    def __repr__(self) -> str:
        return f"LocalKafkaCluster(work_dir={str(self.work_dir)!r}, nodes={len(self.nodes)})"

    def __enter__(self) -> LocalKafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        """The node with KRaft id ``node_id`` (what metadata calls a broker id)."""
        return next(n for n in self.nodes if n.node_id == node_id)

    def start(self) -> None:
        """Start every node that is not running; wait until every broker is registered."""
        stopped = [node for node in self.nodes if not node.running]
        try:
            for node in stopped:
                node.launch()
            for node in stopped:
                node.wait_ready()
            self._wait_registered(_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Controlled shutdown of every node at once (one by one, the last nodes would
        wait for a quorum that is already gone); SIGKILL after ``timeout``."""
        for node in self.nodes:
            node.request_stop()
        for node in self.nodes:
            node.stop(timeout)

    def _wait_registered(self, timeout: float) -> None:
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "logger": logging.getLogger(f"{__name__}.librdkafka"),
        }
        admin = AdminClient(conf)
        deadline = time.monotonic() + timeout
        while len(admin.list_topics(timeout=5).brokers) < len(self.nodes):
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"the local Kafka cluster in {self.work_dir} has not registered all "
                    f"{len(self.nodes)} brokers after {timeout:.0f}s"
                )
            time.sleep(0.2)


def wait_until_answers(
    bootstrap_servers: str, timeout: float, failed: Callable[[], str | None] | None = None
) -> None:
    """Wait until a broker at ``bootstrap_servers`` lists itself in metadata.

    ``failed`` may report that the broker process is gone (then there is no point waiting).
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    host, _, port = bootstrap_servers.split(",", maxsplit=1)[0].rpartition(":")
    deadline = time.monotonic() + timeout
    admin: AdminClient | None = None
    last_error = "port not open"
    while True:
        problem = failed() if failed else None
        if problem:
            raise LocalServerError(problem)
        # The port first, so the client does not log connection refusals meanwhile.
        if port_open(int(port), timeout=0.5, host=host or "127.0.0.1"):
            if admin is None:
                conf: dict[str, Any] = {
                    "bootstrap.servers": bootstrap_servers,
                    "logger": logging.getLogger(f"{__name__}.librdkafka"),
                }
                admin = AdminClient(conf)
            try:
                if admin.list_topics(timeout=2).brokers:
                    return
            except KafkaException as exc:
                last_error = str(exc)
        if time.monotonic() > deadline:
            raise LocalServerError(
                f"Kafka on {bootstrap_servers} not ready after {timeout:.0f}s ({last_error})"
            )
        time.sleep(0.1)


def with_sigcont(proc: subprocess.Popen[bytes]) -> None:
    """Continue a possibly stopped process: a stopped JVM would ignore SIGTERM."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)


def _read_properties(path: Path) -> dict[str, str]:
    result: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result


def _cluster_id() -> str:
    """A random KRaft cluster id (base64url of 16 bytes). One that starts with '-' would
    be read as an option by the storage tool (about 1 start in 64): draw again."""
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not candidate.startswith("-"):
            return candidate
