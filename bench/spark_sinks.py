"""The archive's sinks on a Spark standalone cluster (issue #51): rows/s of Delta Lake
(``--output-format delta``) against Spark's Parquet file sink, same backlog, same run.

A master and two workers (one core, 1 GiB each) from pyspark's own distribution, as
``tests/acceptance/test_spark_cluster.py`` starts them. Each side is the archive job as
users submit it, ``spark-submit spark_jobs/archive.py --available-now``, into a new
folder and checkpoint, the only difference between the sides its ``--output-format``.
Both submits carry the same jars (the Kafka connector, spark-avro and delta-spark), from
the pinned-jar cache with ``--jars`` rather than ``--packages``: no Ivy resolution in the
clock, nor a pom-only ``~/.m2`` entry in the way.

The backlog is the relay's records (bench/spark.py's ``fill``: ~300-byte single-object
Avro ``OrderPlaced`` values, the relay's headers, 3 partitions, transactional), read in
``BATCHES`` micro-batches or so (``--max-offsets-per-trigger``; the transactions' markers
take offsets too). The figure is rows over the summed durations of every batch but the
first, as the driver logs each batch (``archive: batch 3, 1200 rows in, ... 2.1 s``):
the first pays the executors' JVM
warm-up and Python workers' start, which a long-running job pays once, and the
submit's own start (the driver's JVM, the application's registration) is outside both
sides' clocks. Batches read the same topic and decode the same way on both sides, so
the difference is the sink's. Sides interleave round by round (bench/method.py).
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import SCHEMAS, Figure, Scale, Stack
from bench.method import Samples, interleave
from tests.plugins.spark import StandaloneCluster

REPO = Path(__file__).resolve().parents[1]
BATCHES = 4  # the first one warms up, the others are measured
_BATCH_LINE = re.compile(
    r"archive: batch (\d+), (\d+) rows in, \d+ rows out, \d+ quarantined, ([\d.]+) s"
)
SIDES = {"parquet": "Parquet (Spark's file sink)", "delta": "Delta Lake (txnAppId/txnVersion)"}


class SinkRunError(RuntimeError):
    """A submitted archive run failed, or archived other than the whole backlog."""


def measured_rate(driver_log: str, records: int) -> float:
    """Rows/s of every batch but the first, from the driver's per-batch lines; the batches
    must account for all ``records``."""
    batches = {int(b): (int(rows), float(s)) for b, rows, s in _BATCH_LINE.findall(driver_log)}
    if sum(rows for rows, _ in batches.values()) != records or len(batches) < 2:
        raise SinkRunError(f"batches {batches} do not hold the {records} records")
    rows = sum(r for b, (r, _) in batches.items() if b != min(batches))
    seconds = sum(s for b, (_, s) in batches.items() if b != min(batches))
    return rows / max(seconds, 0.05)  # a line says 0.0 s under 50 ms


def submit_argv(
    cluster: StandaloneCluster, jars: list[Path], bootstrap: str, topic: str, folder: Path,
    output_format: str, per_batch: int,
) -> list[str]:  # fmt: skip
    return [str(cluster.home / "bin" / "spark-submit"), "--master", cluster.url,
            "--jars", ",".join(map(str, jars)), str(REPO / "spark_jobs" / "archive.py"),
            "--bootstrap-servers", bootstrap, "--topics", re.escape(topic),
            "--schemas", str(SCHEMAS), "--output-format", output_format,
            "--path", str(folder / "out"), "--checkpoint", str(folder / "ckpt"),
            "--max-offsets-per-trigger", str(per_batch), "--available-now"]  # fmt: skip


def run(stack: Stack, scale: Scale) -> list[Figure]:
    from bench.spark import fill  # pyspark's, as the jars: only where the bench runs
    from spark_jobs.spark_session import connector_jars, delta_jars

    # Quick (40k) finishes in minutes and only tries the method; each batch of the
    # default backlog lasts seconds, well above a line's 0.1 s resolution.
    records = scale.events * 2 // 5 if scale.name == "quick" else scale.events
    topic = f"{stack.topic_prefix('spark-sinks')}.orders"
    fill(stack.bootstrap, topic, records)
    workdir = stack.workdir / "spark-sinks"
    cluster = StandaloneCluster(_spark_home(), _fresh(workdir / "cluster"))
    jars = connector_jars() + delta_jars()
    runs = itertools.count()

    def side(output_format: str) -> float:
        folder = _fresh(workdir / f"run-{next(runs)}-{output_format}")
        argv = submit_argv(cluster, jars, stack.bootstrap, topic, folder, output_format,
                           -(-records // BATCHES))  # fmt: skip
        env = {**cluster.env, "PYSPARK_PYTHON": sys.executable,
               "PYTHONPATH": str(REPO)}  # fmt: skip
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                              check=False, timeout=1800)  # fmt: skip
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise SinkRunError(f"{output_format} run failed ({done.returncode}): {log[-3000:]}")
        rate = measured_rate(log, records)
        print(f"spark_sinks {folder.name}: {rate:.0f} rows/s", file=sys.stderr, flush=True)
        shutil.rmtree(folder / "out", ignore_errors=True)  # the next run's disk
        return rate

    try:
        cluster.start()
        samples = interleave({name: lambda n=name: side(n) for name in SIDES},
                             scale.repetitions)  # fmt: skip
    finally:
        cluster.stop()
    return _figures(samples, records)


def _spark_home() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


def _fresh(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return folder


def _figures(samples: dict[str, Samples], records: int) -> list[Figure]:
    details = {"records": records, "batches": BATCHES, "measured": "batches 1.. (0 warms up)",
               "cluster": "standalone, master + 2 workers x 1 core, 1 GiB"}  # fmt: skip
    return [
        Figure.of("spark_sinks", "archive rows/s on a standalone cluster, Delta Lake",
                  samples["delta"], "rows/s", samples["parquet"], SIDES["parquet"], None,
                  details),
    ]  # fmt: skip
