"""The archive into Delta Lake (issue #51): each event once for every reader, read back
with the ``deltalake`` package (delta-rs), not Spark, through replays and driver kills.

The job runs as users run it (``python -m spark_jobs.archive --output-format delta``):
its session needs delta-spark on the classpath, which the shared ``spark`` fixture has not.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.daemon import Relay
from tests.acceptance.test_spark_jobs import (
    published_story,  # noqa: F401 (a fixture)
    verify_through_command,
)
from tests.support import (
    REPO,
    WriterLoops,
    fenced_blocks,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
)

pytest.importorskip("pyspark")
pytest.importorskip("deltalake")  # docs/spark.md's reader, which archived_ids runs

pytestmark = pytest.mark.spark


class ArchiveDriver:
    """``python -m spark_jobs.archive --output-format delta`` into one table, each run
    logged to a file of its own."""

    def __init__(self, bootstrap: str, topic_prefix: str, folder: Path) -> None:
        self.bootstrap, self.topics = bootstrap, re.escape(topic_prefix) + ".*"
        self.table, self.checkpoint, self.folder = folder / "table", folder / "ckpt", folder
        self.logs: list[Path] = []

    def start(self, *extra: str, checkpoint: Path | None = None) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "spark_jobs.archive", "--output-format", "delta",
                "--bootstrap-servers", self.bootstrap, "--topics", self.topics,
                "--path", str(self.table), "--checkpoint", str(checkpoint or self.checkpoint),
                "--schemas", str(REPO / "schemas"), *extra]  # fmt: skip
        self.logs.append(self.folder / f"driver-{len(self.logs)}.log")
        log = self.logs[-1].open("wb")
        # Its own process group: kill -9 takes the JVM down with the Python driver.
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log, start_new_session=True)

    def run_to_end(self, *extra: str, checkpoint: Path | None = None) -> tuple[int, str]:
        proc = self.start("--available-now", *extra, checkpoint=checkpoint)
        code = proc.wait(timeout=420)
        return code, self.logs[-1].read_text()

    def commits(self) -> list[Path]:
        return sorted((self.table / "_delta_log").glob("*.json"))

    def transactions(self) -> dict[str, int]:
        """Each ``txnAppId`` in the table's log, with its last ``txnVersion``."""
        actions = [json.loads(line) for c in self.commits() for line in c.read_text().splitlines()]
        return {a["txn"]["appId"]: a["txn"]["version"] for a in actions if "txn" in a}

    def query_id(self) -> str:
        return str(json.loads((self.checkpoint / "metadata").read_text())["id"])


class EventsArriving(WriterLoops):
    """An application writing an event about every 0.2 s until stopped."""

    def __init__(self, url: str, outbox: Outbox) -> None:
        super().__init__(url, 1, autocommit=True, pause=0.4)
        self._outbox, self._next = outbox, 0

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        i, self._next = self._next, self._next + 1
        payload = {"order_id": f"o-{i}", "customer_id": "c", "amount_cents": i}  # its schema's
        self._outbox.append(conn, aggregate_type="order", aggregate_id=f"o-{i}",
                            event_type="OrderPlaced", payload=payload)  # fmt: skip

    def _failed(self) -> None:
        """A failed append is retried; the final count is the outbox's own."""


def outbox_rows(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM outbox").fetchone()
    return int(row[0]) if row else 0


def archived_ids(table: Path) -> list[str]:
    """The table's message ids as delta-rs reads it, from the log, no Spark: docs/spark.md's
    block, as written there but for the table's path."""
    [code] = [b for b in fenced_blocks(REPO / "docs" / "spark.md", "python") if "DeltaTable" in b]
    assert '"/data/outbox-delta"' in code
    scope: dict[str, Any] = {}
    exec(code.replace('"/data/outbox-delta"', repr(str(table))), scope)
    return sorted(scope["events"].column("message_id").to_pylist())


@pytest.mark.timeout(1500)  # three drivers, on 2 busy cores
def test_a_replayed_batch_leaves_each_event_once_for_a_non_spark_reader(
    published_story: set[str],  # noqa: F811
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    driver = ArchiveDriver(kafka_bootstrap, topic_prefix, tmp_path)
    code, log = driver.run_to_end()
    assert code == 0, log[-3000:]
    assert re.search(r"^archive: 1 batch, 15 rows in, 15 rows out, 0 quarantined$", log, re.M), log
    assert archived_ids(driver.table) == sorted(published_story)
    assert [p.name for p in driver.table.glob("date=*")]  # partitioned by date
    versions = driver.commits()
    assert driver.transactions() == {driver.query_id(): 0}  # batch 0 of this query

    # Spark forgets it committed the last batch: the restart runs it again, same offsets.
    last = max(driver.checkpoint.glob("commits/[0-9]*"), key=lambda p: int(p.name))
    last.unlink()
    last.with_name(f".{last.name}.crc").unlink(missing_ok=True)  # or Spark sees a rival query
    code, log = driver.run_to_end()
    assert code == 0, log[-3000:]
    # Batch 0 ran again, and Delta skipped its write before reading a row of it.
    assert re.search(r"^archive: 1 batch, 0 rows in, 0 rows out, 0 quarantined$", log, re.M), log
    assert archived_ids(driver.table) == sorted(published_story)
    assert driver.commits() == versions  # the replay committed nothing

    # A new checkpoint would start over at batch 0 under a new query id: refused.
    code, log = driver.run_to_end(checkpoint=tmp_path / "new-ckpt")
    assert code == 1 and "Use a new --path" in log, log[-3000:]


@pytest.mark.timeout(2400)  # three drivers, two of them killed, on 2 busy cores
def test_every_event_once_through_driver_kills(
    db: psycopg.Connection[Any],
    writer_url: str,
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    relay_url: str,
    tmp_path: Path,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)])
    driver = ArchiveDriver(kafka_bootstrap, topic_prefix, tmp_path)
    arriving = EventsArriving(writer_url, outbox)
    arriving.start()
    # The topic exists before a driver subscribes: Kafka's consumer sees a new topic of
    # its pattern only at its next metadata refresh, minutes away.
    wait_until(lambda: outbox_rows(db) > 0, 30, "a first event")
    wait_caught_up(db, "s", timeout=60)
    rng = random.Random(51)
    try:
        for _ in range(2):
            before = len(driver.commits())
            proc = driver.start()
            # Die mid-stream: once this driver has committed a batch, at a random moment.
            wait_until(lambda: len(driver.commits()) > before, 240, "a Delta commit")  # noqa: B023
            time.sleep(rng.uniform(0.5, 3.0))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        arriving.stop()
    wait_caught_up(db, "s", timeout=60)
    code, log = driver.run_to_end()
    assert code == 0, log[-3000:]

    ids = [str(r[0]) for r in db.execute("SELECT message_id FROM outbox").fetchall()]
    assert len(ids) > 30
    assert archived_ids(driver.table) == sorted(ids)  # none missing, none twice

    # verify --through delta, as docs/spark.md runs it: clean, every event found once.
    secret = tmp_path / "database-url"
    secret.write_text(relay_url)
    argv = [
        {"/data/outbox-delta": str(driver.table), "default": "s"}.get(w, w)
        for w in verify_through_command("delta")[1:]
    ]
    done = run_cli(*argv, env={"RELAY_DATABASE_URL_FILE": str(secret)})
    assert done.returncode == 0, done.stdout + done.stderr
    [report] = json.loads(done.stdout)
    assert (report["expected"], report["found"], report["verdict"]) == (len(ids), len(ids), "clean")
