"""Issue #51: docs/spark-clusters.md's packed-venv recipe, run as the page writes it (its
bash block read from the page; only the hosts, the shared folder and the tools' paths
substituted, as test_spark_cluster.py does): a venv built from this checkout, packed with
venv-pack, and the archive job submitted with ``--archives`` to a standalone master and
two workers. The executors decode in the unpacked venv's Python (the Arrow UDF imports
this package): without the archive they have no such interpreter and the job fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")

from relay import Outbox
from relay.localstack import LocalKafka
from tests.acceptance.test_spark_cluster import archived_rows, publish_orders
from tests.acceptance.test_spark_readme import (  # noqa: F401  (no_job_left: autouse)
    REPO,
    WAIT_S,
    Job,
    broker,
    no_job_left,
    readme_commands,
    substituted,
)
from tests.plugins.spark import StandaloneCluster

CLUSTERS_PAGE = REPO / "docs" / "spark-clusters.md"


def packed_venv_recipe() -> tuple[dict[str, str], list[list[str]]]:
    """The page's packed-venv block: what it exports, and each command line in order."""
    return readme_commands("### A packed virtual environment", (), CLUSTERS_PAGE)


def run_step(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.spark
@pytest.mark.timeout(3 * WAIT_S)
def test_the_archive_runs_from_a_packed_venv_as_the_cluster_page_ships_it(
    spark_standalone: StandaloneCluster,
    broker: LocalKafka,  # noqa: F811
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    tmp_path: Path,
) -> None:
    bootstrap = broker.bootstrap_servers
    committed = publish_orders(db, writer_db, outbox, relay_url, bootstrap)

    exported, commands = packed_venv_recipe()
    assert exported == {"PYSPARK_DRIVER_PYTHON": "relay-env/bin/python",
                        "PYSPARK_PYTHON": "./environment/bin/python"}  # fmt: skip
    steps = ["python3.11", "relay-env/bin/pip", "venv-pack", "spark-submit"]
    assert [argv[0] for argv in commands] == steps
    # The venv's paths stay relative, as written: every step runs in tmp_path.
    paths = {"python3.11": sys.executable, "venv-pack": str(Path(sys.executable).parent / "venv-pack"),
             "spark-submit": str(spark_standalone.home / "bin" / "spark-submit"),
             "spark://spark-master:7077": spark_standalone.url, "kafka:9092": bootstrap,
             "spark_jobs/": f"{REPO}/spark_jobs/", "/shared/": f"{tmp_path}/"}  # fmt: skip
    # Ivy resolves --packages from ~/.m2 first, where a Maven build may have left a pom
    # without its jar ("download failed: org.slf4j#slf4j-api"): a home of its own.
    home = f"-Duser.home={tmp_path / 'home'}"
    env = {**spark_standalone.env, **exported}
    env["SPARK_SUBMIT_OPTS"] = f"{env.get('SPARK_SUBMIT_OPTS', '')} {home}"  # after the tests' own
    *build, submit = [
        [str(REPO) if word == "." else word for word in substituted(argv, paths)]
        for argv in commands
    ]  # `pip install .`: this checkout
    for argv in build:
        run_step(argv, env, tmp_path)

    job = Job(submit, env, tmp_path / "archive.log")
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-5000:]
    rows = archived_rows(tmp_path / "outbox-archive")
    assert sorted(r["message_id"] for r in rows) == sorted(committed)  # each once
    assert [r for r in rows if r["error"] is not None] == []  # decoded on the executors
    # The executors ran from the archive, unpacked in their working folders.
    assert list(spark_standalone.folder.glob("worker-*/app-*/*/environment/bin/python"))
