"""A Kafka Connect distributed worker with exactly-once source support (KIP-618), running
Debezium's PostgreSQL connector: the like-for-like exactly-once peer of the relay in
bench/debezium.py.

The jars are pinned in ``relay/artifacts/kafka-connect.lock`` (Apache Kafka's
``connect-runtime``, Debezium's ``debezium-connector-postgres`` and what they need),
fetched once into the user's cache like every jar of the local stack. The worker runs
with ``exactly.once.source.support=enabled``; the connector is created with
``exactly.once.support=required`` and ``transaction.boundary=poll``: every batch the task
returns from one poll is one Kafka transaction, with its source offsets, which the
worker writes in the same transaction.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relay.artifacts.maven import fetch_lock
from relay.localstack.debezium import find_java21
from relay.localstack.process import (
    LocalServer,
    LocalServerError,
    free_port,
    log_tail,
    reaper,
    signal_and_wait,
    spawn,
)

_log = logging.getLogger(__name__)

LOCK = "kafka-connect"
CONNECTOR = "outbox"
_START_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 60.0
STRING = "org.apache.kafka.connect.storage.StringConverter"


def connector_config(server_properties: Mapping[str, str]) -> dict[str, str]:
    """The connector's configuration from Debezium Server's properties: the source's
    (``debezium.source.*``) and the transforms' (``debezium.transforms*``) without their
    prefix; the sink's and the formats' are the worker's (see :func:`worker_config`)."""
    config: dict[str, str] = {}
    for name, value in server_properties.items():
        if name.startswith("debezium.source.") and "offset.storage" not in name:
            config[name.removeprefix("debezium.source.")] = value
        elif name.startswith("debezium.transforms"):
            config[name.removeprefix("debezium.")] = value
    return {**config, "tasks.max": "1", "exactly.once.support": "required",
            "transaction.boundary": "poll"}  # fmt: skip


def worker_config(
    bootstrap: str, group: str, port: int, server_properties: Mapping[str, str]
) -> dict[str, str]:
    """A distributed worker of its own group, with exactly-once source support; its
    producers take Debezium Server's sink producer settings (``producer.*``)."""
    producer = {
        f"producer.{name.removeprefix('debezium.sink.kafka.producer.')}": value
        for name, value in server_properties.items()
        if name.startswith("debezium.sink.kafka.producer.")
        and not name.endswith(("bootstrap.servers", "serializer"))
    }
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "exactly.once.source.support": "enabled",
        "key.converter": STRING,
        "value.converter": STRING,
        "config.storage.topic": f"{group}.configs",
        "offset.storage.topic": f"{group}.offsets",
        "status.storage.topic": f"{group}.status",
        "config.storage.replication.factor": "1",
        "offset.storage.replication.factor": "1",
        "status.storage.replication.factor": "1",
        "offset.storage.partitions": "1",
        "status.storage.partitions": "1",
        "listeners": f"http://127.0.0.1:{port}",
        "rest.advertised.host.name": "127.0.0.1",
        "rest.advertised.port": str(port),
        "offset.flush.interval.ms": "60000",
        **producer,
    }


def _properties_text(config: Mapping[str, str]) -> str:
    return "".join(
        f"{name}={value.replace(chr(92), chr(92) * 2)}\n" for name, value in config.items()
    )


class LocalConnectWorker(LocalServer):
    """One ``ConnectDistributed`` worker; :meth:`create` posts the connector once."""

    def __init__(
        self, work_dir: Path, worker: Mapping[str, str], jvm_options: Sequence[str] = ()
    ) -> None:
        self.work_dir = Path(work_dir).absolute()
        self.worker = dict(worker)
        self.jvm_options = tuple(jvm_options)
        self.log_path = self.work_dir / "connect.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.worker["listeners"]

    def start(self) -> None:
        """Start the worker; returns once its REST API answers."""
        if self.running:
            return
        jars = fetch_lock(LOCK)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "worker.properties"
        config.write_text(_properties_text(self.worker))
        argv = [find_java21(), *self.jvm_options, "-cp", ":".join(str(j) for j in jars),
                "org.apache.kafka.connect.cli.ConnectDistributed", str(config)]  # fmt: skip
        with self.log_path.open("ab") as out:
            self._proc = spawn(argv, out, cwd=self.work_dir)
        reaper.add(self)
        self._wait(lambda: self._get("/") is not None, "its REST API to answer")

    def create(self, config: Mapping[str, str]) -> None:
        """Create (or update) the connector, and wait until its task runs."""
        self._request("PUT", f"/connectors/{CONNECTOR}/config", dict(config))
        self.wait_task_running()

    def wait_task_running(self) -> None:
        def running() -> bool:
            status = self._get(f"/connectors/{CONNECTOR}/status")
            tasks = (status or {}).get("tasks", [])
            failed = [t for t in tasks if t.get("state") == "FAILED"]
            if failed:
                raise LocalServerError(f"the connector's task failed: {failed[0].get('trace')}")
            return bool(tasks) and all(t.get("state") == "RUNNING" for t in tasks)

        self._wait(running, "the connector's task to run")

    def stop_connector(self) -> None:
        """Stop the connector (KIP-875): its task ends, committing what it published;
        it keeps its configuration and offsets."""
        self._request("PUT", f"/connectors/{CONNECTOR}/stop")

        def stopped() -> bool:
            status = self._get(f"/connectors/{CONNECTOR}/status") or {}
            return status.get("connector", {}).get("state") == "STOPPED" and not status.get("tasks")

        self._wait(stopped, "the connector to stop")

    def resume_connector(self) -> None:
        """Start the stopped connector again, from its offsets."""
        self._request("PUT", f"/connectors/{CONNECTOR}/resume")

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Graceful stop: the task commits what it published, offsets included."""
        if self._proc is not None:
            signal_and_wait(self._proc, signal.SIGTERM, timeout, "kafka-connect")
            self._proc = None
        reaper.discard(self)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not done():
            if not self.running:
                raise LocalServerError(
                    f"Kafka Connect exited waiting for {what}; its log:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"timed out waiting for {what}; Kafka Connect's log:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _get(self, path: str) -> Any:
        try:
            return self._request("GET", path)
        except (OSError, LocalServerError):
            return None

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data, {"Content-Type": "application/json"}, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise LocalServerError(
                f"Kafka Connect answered {exc.code} to {method} {path}: {exc.read()[:2000]!r}"
            ) from exc


def new_worker(
    work_dir: Path, bootstrap: str, group: str, server_properties: Mapping[str, str],
    jvm_options: Sequence[str] = (),
) -> LocalConnectWorker:  # fmt: skip
    return LocalConnectWorker(
        work_dir, worker_config(bootstrap, group, free_port(), server_properties), jvm_options
    )
