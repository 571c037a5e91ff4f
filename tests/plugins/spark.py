"""One local Spark session for the whole test session (``spark``, skipped without
pyspark), and a Spark standalone cluster (``spark_standalone``): a master and two
workers started from pyspark's own jars and scripts, as a user's cluster runs them."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from relay.localstack.process import free_port, log_tail, signal_and_wait, spawn
from tests.support import wait_until

# The JIT's first tier only, and the serial collector: a test's Spark JVM lives seconds
# to a minute on small data, where C2 compiling and G1's threads cost more CPU than they
# save (measured: half the JVM's CPU time for a small job). Test-only: drivers get them
# through the variable spark-submit adds to the driver's java command, a standalone
# cluster's master, workers and executors through its conf folder's ``java-opts``. The
# jobs' results are the same.
TEST_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="session", autouse=True)
def _quick_spark_drivers() -> Iterator[None]:
    """Every Spark driver a test starts (the ``spark`` session, ``python -m`` jobs,
    ``spark-submit``) with :data:`TEST_JAVA_OPTIONS`, unless whoever runs the
    tests set SPARK_SUBMIT_OPTS: theirs alone then (a JVM refuses two collectors)."""
    with pytest.MonkeyPatch.context() as patch:
        if "SPARK_SUBMIT_OPTS" not in os.environ:
            patch.setenv("SPARK_SUBMIT_OPTS", TEST_JAVA_OPTIONS)
        yield


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every Spark test (starting one takes seconds)."""
    pytest.importorskip("pyspark")
    from spark_jobs.spark_session import local_spark_session

    session = local_spark_session("outbox-relay-tests")
    yield session
    session.stop()
    # py4j logs from connection finalizers at interpreter exit, after pytest has closed
    # the streams its handlers write to: a "Logging error" traceback under a green run.
    logging.getLogger("py4j").setLevel(logging.WARNING)


EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


@dataclass
class StandaloneCluster:
    """A Spark standalone master and its workers, each a JVM of ours (``spark-class``
    execs it), on free ports of 127.0.0.1; the executors are the workers' children."""

    home: Path  # pyspark's SPARK_HOME: bin/spark-class, bin/spark-submit, jars/
    folder: Path
    workers: int = 2
    port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What its JVMs and a ``spark-submit`` to it run with: this SPARK_HOME, on the
        loopback (the machine may have other interfaces)."""
        return {**os.environ, "SPARK_HOME": str(self.home), "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.folder / "logs")}  # fmt: skip

    def start(self) -> None:
        # Read by every java command Spark's launcher builds from the daemons' conf
        # folder: theirs, and the executors' the workers start. pyspark ships no conf
        # folder, so this one holds nothing else.
        (self.folder / "conf").mkdir()
        (self.folder / "conf" / "java-opts").write_text(TEST_JAVA_OPTIONS + "\n")
        master = "org.apache.spark.deploy.master.Master"
        self._spawn("master", master, "--host", "127.0.0.1", "--port", str(self.port),
                    "--webui-port", str(self.ui_port))  # fmt: skip
        # Spark takes the next port when one is taken meanwhile: the ports it says it bound.
        wait_until(self._bound, 120, "the Spark master's ports\n" + self.logs())
        wait_until(lambda: self.state() is not None, 120, "the Spark master's UI")
        for n in range(self.workers):
            work = self.folder / f"worker-{n}"
            self._spawn(f"worker-{n}", "org.apache.spark.deploy.worker.Worker",
                        "--host", "127.0.0.1", "--webui-port", "0", "--cores", "1",
                        "--memory", "1g", "--work-dir", str(work), self.url)  # fmt: skip
        wait_until(
            lambda: (self.state() or {}).get("aliveworkers") == self.workers, 120,
            f"{self.workers} Spark workers registered\n" + self.logs(),
        )  # fmt: skip

    def _spawn(self, name: str, main_class: str, *args: str) -> None:
        with (self.folder / f"{name}.log").open("ab") as log:
            env = {**self.env, "SPARK_CONF_DIR": str(self.folder / "conf")}
            self.procs[name] = spawn([str(self.home / "bin" / "spark-class"), main_class, *args],
                                     log, cwd=self.folder, env=env)  # fmt: skip

    def _bound(self) -> bool:
        log = (self.folder / "master.log").read_text(errors="replace")
        master = re.search(r"Starting Spark master at spark://127\.0\.0\.1:(\d+)", log)
        ui = re.search(r"Successfully started service 'MasterUI' on port (\d+)", log)
        if master is None or ui is None:
            return False
        self.port, self.ui_port = int(master[1]), int(ui[1])
        return True

    def state(self) -> dict[str, Any] | None:
        """The master's JSON status (workers, running and completed applications)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
                answer: dict[str, Any] = json.load(r)
                return answer
        except (OSError, ValueError):  # not up yet, or its HTML page while it starts
            return None

    def executors(self) -> list[int]:
        """The pids of the executor JVMs the workers run now."""
        workers = {p.pid for name, p in self.procs.items() if name.startswith("worker")}
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid in workers and EXECUTOR_CLASS.encode() in cmdline:
                found.append(int(stat.parent.name))
        return found

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{log_tail(self.folder / f'{name}.log')}" for name in self.procs
        )

    def stop(self) -> None:
        for name, proc in reversed(self.procs.items()):
            signal_and_wait(proc, signal.SIGTERM, 30, f"spark {name}")


_TASK = re.compile(r"(Running|Finished) task .*\(TID (\d+)\)")


def running_tasks(executor: int) -> set[str]:
    """The tasks (TIDs) an executor has started and not finished, from its log
    (``stderr`` in its working folder, at Spark's default INFO level)."""
    try:
        log = Path(f"/proc/{executor}/cwd/stderr").read_text(errors="replace")
    except OSError:
        return set()
    seen: dict[str, set[str]] = {"Running": set(), "Finished": set()}
    for what, tid in _TASK.findall(log):
        seen[what].add(tid)
    return seen["Running"] - seen["Finished"]


@pytest.fixture(scope="module")
def spark_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A Spark standalone master and two workers (one core, 1 GiB each) from pyspark's
    own distribution: ``spark-submit --master spark_standalone.url``."""
    pytest.importorskip("pyspark")
    from pyspark.find_spark_home import _find_spark_home

    cluster = StandaloneCluster(
        Path(_find_spark_home()), tmp_path_factory.mktemp("spark-standalone")
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
