"""Issue #51: each job submitted with ``spark-submit`` to a Spark standalone cluster (a
master and two workers from pyspark's own distribution), exactly as README.md's cluster
block submits it (read from the README), with an executor killed (``kill -9``) while it
runs a task of the archive's batch. Each sink ends with each committed event once; the
Delta archive, submitted as docs/spark.md's Delta block submits it, too, read back with
``deltalake`` (no Spark)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")

from relay import Outbox
from relay.localstack import LocalKafka
from tests.acceptance.test_spark_readme import (  # noqa: F401  (no_job_left: autouse)
    EXPECTED_AVERAGES,
    REPO,
    WAIT_S,
    Job,
    as_expected,
    averages,
    broker,
    no_job_left,
    publish_with_defaults,
    readme_commands,
    substituted,
    write_numbers,
)
from tests.plugins.spark import StandaloneCluster, running_tasks

ORDERS = 1000  # and a shipment of every other one: a batch that runs for seconds
_BATCH = re.compile(r"\d+(\.compact)?")  # a file sink log's entry (not its .crc)
MAX_KILLS = 3  # executors killed, at most, until one dies with a task running


def readme_cluster_commands() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The README cluster block's environment, and its command line for each job."""
    env, commands = readme_commands("On a cluster, `spark-submit` runs", ("spark-submit",))
    return env, {Path(next(w for w in c if w.endswith(".py"))).stem: c for c in commands}


def delta_submit_command() -> list[str]:
    """The Spark page's ``spark-submit`` line of the Delta archive (its Delta section)."""
    [command] = readme_commands("## The archive in Delta Lake", ("spark-submit",))[1]
    return command


def submitting(
    cluster: StandaloneCluster, bootstrap: str, database_url: str, folder: Path
) -> tuple[dict[str, str], dict[str, str]]:
    """What a docs' ``spark-submit`` line runs with here: the cluster block's exports (this
    interpreter on every node, the database URL in a file), and each placeholder of the
    line (the tool, the master, the broker, the job's file, the shared folder) made ours."""
    secret = folder / "database-url"
    secret.write_text(database_url)
    env = {**cluster.env, "PYSPARK_PYTHON": sys.executable,
           "RELAY_DATABASE_URL_FILE": str(secret)}  # fmt: skip
    paths = {"spark-submit": str(cluster.home / "bin" / "spark-submit"),
             "spark://spark-master:7077": cluster.url, "kafka:9092": bootstrap,
             "spark_jobs/": f"{REPO}/spark_jobs/", "/shared/": f"{folder}/"}  # fmt: skip
    return env, paths


def write_orders(db: psycopg.Connection[Any], outbox: Outbox) -> None:
    """``ORDERS`` orders placed, every other one shipped, 100 events a transaction; and
    one transaction rolled back, whose event no sink may hold."""
    events = [("OrderPlaced", i, {}) for i in range(ORDERS)]
    events += [("OrderShipped", i, {"carrier": "dhl"}) for i in range(0, ORDERS, 2)]
    for start in range(0, len(events), 100):
        with db.transaction():
            for kind, i, extra in events[start : start + 100]:
                payload = {"order_id": f"o-{i}", "customer_id": f"c-{i % 7}",
                           "amount_cents": i, **extra}  # fmt: skip
                outbox.append(db, aggregate_type="order", aggregate_id=f"o-{i}",
                              event_type=kind, payload=payload)  # fmt: skip
    with db.transaction():
        outbox.append(db, aggregate_type="order", aggregate_id="o-rolled-back",
                      event_type="OrderPlaced", payload={"order_id": "o-rolled-back",
                      "customer_id": "c-0", "amount_cents": 1})  # fmt: skip
        raise psycopg.Rollback


def publish_orders(
    db: psycopg.Connection[Any], writer_db: psycopg.Connection[Any], outbox: Outbox,
    relay_url: str, bootstrap: str,
) -> list[str]:  # fmt: skip
    """``write_orders``, published by a relay with its defaults: the committed events' ids."""
    publish_with_defaults(db, relay_url, bootstrap, lambda: write_orders(writer_db, outbox))
    return [str(r[0]) for r in db.execute("SELECT message_id FROM outbox").fetchall()]


def archived_rows(archive: Path) -> list[dict[str, Any]]:
    """The rows of the Parquet files Spark's file sink committed to ``archive``."""
    import pyarrow.parquet as pq

    return [row for f in committed_files(archive) for row in pq.read_table(f).to_pylist()]


def committed_files(archive: Path) -> list[Path]:
    """The Parquet files Spark's file sink committed: those its ``_spark_metadata`` log
    lists (a killed task's files may lie in the folder too, for no Spark reader)."""
    files: set[str] = set()
    batches = [f for f in (archive / "_spark_metadata").iterdir() if _BATCH.fullmatch(f.name)]
    for entry in sorted(batches, key=lambda f: int(f.name.removesuffix(".compact"))):
        for line in entry.read_text().splitlines()[1:]:  # after the "v1" version line
            record = json.loads(line)
            if record["action"] == "add":
                files.add(record["path"])
            else:
                files.discard(record["path"])
    return [Path(f.removeprefix("file:")) for f in sorted(files)]


def kill_an_executor_mid_task(cluster: StandaloneCluster, job: Job) -> int:
    """Kill -9 executors that run a task, until the driver says a task was lost with
    one (or the job ends); returns how many were killed."""
    kills = 0
    while job.proc.poll() is None and kills < MAX_KILLS:
        if "ExecutorLostFailure" in job.output():
            break
        busy = [pid for pid in cluster.executors() if running_tasks(pid)]
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            kills += 1
            time.sleep(2)  # the driver hears of it
        time.sleep(0.1)
    return kills


def archive_through_an_executor_kill(cluster: StandaloneCluster, job: Job, total: int) -> str:
    """The archive ``job`` to its end, an executor killed while it ran a task of a batch,
    and each of the ``total`` events in and out: the driver's output."""
    kills = kill_an_executor_mid_task(cluster, job)
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-5000:]
    out = job.output()
    lost = r"\[batchId = \d+\] Lost task .*ExecutorLostFailure"  # mid-batch, as Spark says
    assert re.search(lost, out), f"no task lost in {kills} kills: {out[-5000:]}"
    assert re.search(rf"^archive: \d+ batch(es)?, {total} rows in, {total} rows out, 0 quarantined$",
                     out, re.M), out[-3000:]  # fmt: skip
    return out


@pytest.mark.spark
@pytest.mark.chaos
@pytest.mark.timeout(3 * WAIT_S)
def test_each_job_runs_on_a_standalone_cluster_as_the_readme_submits_it(
    spark_standalone: StandaloneCluster,
    broker: LocalKafka,  # noqa: F811
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_url: str,
    tmp_path: Path,
) -> None:
    bootstrap = broker.bootstrap_servers
    committed = publish_orders(db, writer_db, outbox, relay_url, bootstrap)
    assert len(committed) == ORDERS + ORDERS // 2

    exported, commands = readme_cluster_commands()
    assert exported.keys() == {"PYSPARK_PYTHON", "RELAY_DATABASE_URL_FILE"}
    assert commands.keys() == {"order_projection", "window_average", "archive"}
    env, paths = submitting(spark_standalone, bootstrap, database_url, tmp_path)

    def submit(name: str) -> Job:
        return Job(substituted(commands[name], paths), env, tmp_path / f"{name}.log")

    # (c) The archive, an executor killed while it runs a task of the batch.
    out = archive_through_an_executor_kill(spark_standalone, submit("archive"), len(committed))
    rows = archived_rows(tmp_path / "outbox-archive")
    assert sorted(r["message_id"] for r in rows) == sorted(committed)  # each once
    assert [r for r in rows if r["error"] is not None] == []
    # The driver's progress lines and Spark's UI, on by default on a cluster.
    assert re.search(r"INFO spark_jobs.run_summary: archive: batch 0, \d+ rows in", out), out[
        -3000:
    ]
    assert "for SparkUI" in out, out[-3000:]

    # (a) The order projection.
    job = submit("order_projection")
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-5000:]
    rows = db.execute(
        "SELECT order_id, customer_id, amount_cents, status, carrier FROM orders"
    ).fetchall()
    assert sorted(rows) == sorted(
        (f"o-{i}", f"c-{i % 7}", i, "shipped" if i % 2 == 0 else "placed", "dhl" if i % 2 == 0 else None)
        for i in range(ORDERS)
    )  # fmt: skip

    # (b) The window averages, with the --conf it was given kept in its checkpoint.
    argv = commands["window_average"]
    inputs = argv[argv.index("--topics") + 1].split(",")
    write_numbers(bootstrap, inputs)
    job = submit("window_average")
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-5000:]
    output = argv[argv.index("--output-topic") + 1]
    assert as_expected(averages(bootstrap, output)) == EXPECTED_AVERAGES  # each window once
    offsets = (tmp_path / "spark" / "win" / "offsets" / "0").read_text().splitlines()
    assert json.loads(offsets[1])["conf"]["spark.sql.shuffle.partitions"] == "2"

    # Each ran on the cluster: the master it was given, not local[2].
    apps = [app["name"] for app in (spark_standalone.state() or {})["completedapps"]]
    assert sorted(apps) == ["archive", "order_projection", "window_average"]


@pytest.mark.spark
@pytest.mark.chaos
@pytest.mark.timeout(3 * WAIT_S)
def test_the_delta_archive_keeps_each_event_once_through_an_executor_kill(
    spark_standalone: StandaloneCluster,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_url: str,
    tmp_path: Path,
) -> None:
    """The Delta archive submitted as docs/spark.md submits it (``--packages`` with
    delta-spark), an executor killed mid-batch: every committed event once, none rolled
    back, as delta-rs reads the table from its log."""
    # The page's reader; its module skips without deltalake: then this test alone.
    from tests.acceptance.test_spark_delta import archived_ids

    # A broker of its own: the module's holds the other test's events on the same topic.
    with LocalKafka(tmp_path / "kafka") as kafka:
        committed = publish_orders(db, writer_db, outbox, relay_url, kafka.bootstrap_servers)
        env, paths = submitting(spark_standalone, kafka.bootstrap_servers, database_url, tmp_path)
        # Ivy resolves --packages from ~/.m2 first, where a Maven build may have left a
        # pom without its jar: a home of its own, as test_spark_clusters_doc.py gives it.
        env["SPARK_SUBMIT_OPTS"] = (
            f"{env.get('SPARK_SUBMIT_OPTS', '')} -Duser.home={tmp_path / 'home'}"
        )
        job = Job(substituted(delta_submit_command(), paths), env, tmp_path / "delta.log")
        archive_through_an_executor_kill(spark_standalone, job, len(committed))
    assert archived_ids(tmp_path / "outbox-delta") == sorted(committed)  # each once, no other


def test_the_k8s_example_submits_the_archive_as_the_readme_does() -> None:
    """deploy/k8s/examples/spark-archive.yaml's commented ``spark-submit`` is the README's
    archive line with a k8s:// master: the same packages, the job's same options."""
    text = (REPO / "deploy" / "k8s" / "examples" / "spark-archive.yaml").read_text()
    comment = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(comment) if line.startswith("spark-submit"))
    end = next(i for i in range(start, len(comment)) if not comment[i].endswith("\\"))
    k8s = shlex.split(" ".join(line.removesuffix("\\") for line in comment[start : end + 1]))
    readme = readme_cluster_commands()[1]["archive"]

    def after(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    def job_options(argv: list[str]) -> list[str]:
        script = next(i for i, word in enumerate(argv) if word.endswith("/archive.py"))
        return [word for word in argv[script:] if word.startswith("--")]

    assert after(k8s, "--master").startswith("k8s://")
    assert after(k8s, "--packages") == after(readme, "--packages")
    assert job_options(k8s) == job_options(readme)
