"""Spark jobs end to end: outbox → relay → Kafka → Spark → Postgres, exactly once."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from relay import Outbox
from relay.daemon import Relay
from spark_jobs import order_projection
from spark_jobs.job import failure_reason
from tests.support import run_cli, sub, wait_caught_up

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]


def write_order_story(
    writer_db: psycopg.Connection[Any], outbox: Outbox, between: Callable[[], object] = dict
) -> None:
    """Ten orders placed, then (after ``between``) every other one shipped."""
    for i in range(10):
        with writer_db.transaction():
            payload = {"order_id": f"o-{i}", "customer_id": f"c-{i % 3}", "amount_cents": 100 * i}
            outbox.append(writer_db, aggregate_type="order", aggregate_id=f"o-{i}",
                          event_type="OrderPlaced", payload=payload)  # fmt: skip
    between()
    for i in range(0, 10, 2):
        outbox.append(writer_db, aggregate_type="order", aggregate_id=f"o-{i}",
                      event_type="OrderShipped", payload={"order_id": f"o-{i}", "carrier": "dhl"})  # fmt: skip


# Order events an app may write (legal under the relay's JSON defaults) that the orders
# table cannot take: by aggregate id (the record's key), the payload and the reason.
UNAPPLICABLE: dict[str, tuple[dict[str, Any], str]] = {
    "no-id": ({"customer_id": "c-1", "amount_cents": 5}, "no order_id"),
    "huge": (
        {"order_id": "o-huge", "amount_cents": 2**70},
        f"amount_cents is not a whole number within bigint: {2**70}",
    ),
    # A rule the operator added to the table: only Postgres knows it.
    "banned": (
        {"order_id": "o-banned", "customer_id": "c-banned"},
        'refused by Postgres: CheckViolation: new row for relation "orders" violates check '
        'constraint "no_banned_customers"',
    ),
}


def write_unapplicable_orders(writer_db: psycopg.Connection[Any]) -> None:
    json_app = Outbox(None)  # an app that publishes JSON only: its payloads are not validated
    for key, (payload, _) in UNAPPLICABLE.items():
        json_app.append(writer_db, aggregate_type="order", aggregate_id=key,
                      event_type="OrderPlaced", payload=payload)  # fmt: skip


def run_projection(
    spark: SparkSession, url: str, bootstrap: str, topic: str, ckpt: Path, **options: Any
) -> int:
    options = {"schemas": str(REPO / "schemas"), **options}
    query = order_projection.start(
        spark,
        bootstrap_servers=bootstrap,
        topic=topic,
        database_url=url,
        checkpoint=str(ckpt),
        available_now=True,
        **options,
    )
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return sum(p["numInputRows"] for p in query.recentProgress)


@pytest.mark.timeout(1800)  # three runs of the query, on 2 busy cores
def test_projection_is_exact_quarantines_what_it_cannot_apply_and_a_replay_changes_nothing(
    spark: SparkSession,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    tmp_path: Path,
) -> None:
    """Issue #48: order events the table cannot take, among good ones, used to fail
    every run at batch 0. They are quarantined with their reason, exactly once."""
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    order_projection.ensure_tables(database_url)  # the owner's own rule on its read model
    db.execute(
        "ALTER TABLE orders ADD CONSTRAINT no_banned_customers CHECK (customer_id <> 'c-banned')"
    )
    write_order_story(writer_db, outbox, between=lambda: write_unapplicable_orders(writer_db))
    wait_caught_up(db, "s", timeout=60)
    topic, ckpt = topic_prefix + "outbox.event.order", tmp_path / "ckpt"

    # A batch that fails (a migration holds the table): the one line names the root
    # cause, the Python exception inside Spark's and py4j's wrappers.
    holder = psycopg.connect(database_url)
    try:
        holder.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        query = order_projection.start(
            spark, bootstrap_servers=kafka_bootstrap, topic=topic,
            database_url=make_conninfo(database_url, options="-c lock_timeout=1000"),
            checkpoint=str(ckpt), schemas=str(REPO / "schemas"), available_now=True,
        )  # fmt: skip
        with pytest.raises(Exception, match="LockNotAvailable") as failed:
            query.awaitTermination(300)
    finally:
        holder.close()
    assert failure_reason(failed.value) == (
        "LockNotAvailable: canceling statement due to lock timeout"
    )
    assert last_batch(db) == -1  # nothing written

    # JSON values (the relay without schemas): the job needs no schemas folder.
    json_only = {"schemas": None}
    assert run_projection(spark, database_url, kafka_bootstrap, topic, ckpt, **json_only) == 18
    expected = [
        (f"o-{i}", f"c-{i % 3}", 100 * i, "shipped" if i % 2 == 0 else "placed",
         "dhl" if i % 2 == 0 else None)
        for i in range(10)
    ]  # fmt: skip
    query = (
        "SELECT order_id, customer_id, amount_cents, status, carrier FROM orders ORDER BY position"
    )
    quarantined = (
        "SELECT key, error FROM spark_corrupt_records WHERE sink = 'order-projection' ORDER BY 1"
    )
    reasons = sorted((key, why) for key, (_, why) in UNAPPLICABLE.items())
    assert sorted(db.execute(query).fetchall()) == sorted(expected)
    assert db.execute(quarantined).fetchall() == reasons

    # A driver crash after the sink committed but before Spark logged the batch: Spark
    # runs the batch again on restart. The marker makes the sink skip it.
    commits = sorted((ckpt / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    commits[-1].unlink()
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    assert run_projection(spark, database_url, kafka_bootstrap, topic, ckpt, **json_only) == 18
    assert sorted(db.execute(query).fetchall()) == sorted(expected)
    assert db.execute(quarantined).fetchall() == reasons
    markers = db.execute("SELECT count(*), sum(rows) FROM spark_sink_batches").fetchone()
    assert markers == (1, 18)


@pytest.mark.timeout(900)
def test_verify_through_the_projection_finds_each_orders_last_event(
    spark: SparkSession,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    tmp_path: Path,
) -> None:
    """docs/spark.md's ``verify --through projection`` line after a run: clean, what the
    job quarantined reported as such; then a row set back to an older event (missing)
    and one at no committed event (not in outbox)."""
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    order_projection.ensure_tables(database_url)
    db.execute(
        "ALTER TABLE orders ADD CONSTRAINT no_banned_customers CHECK (customer_id <> 'c-banned')"
    )
    write_order_story(writer_db, outbox, between=lambda: write_unapplicable_orders(writer_db))
    wait_caught_up(db, "s", timeout=60)
    topic = topic_prefix + "outbox.event.order"
    run_projection(spark, database_url, kafka_bootstrap, topic, tmp_path / "ckpt", schemas=None)
    secrets = {"RELAY_DATABASE_URL_FILE": relay_url, "RELAY_SINK_URL_FILE": database_url}
    for variable, url in secrets.items():
        (tmp_path / variable).write_text(url)
    env = {variable: str(tmp_path / variable) for variable in secrets}
    argv = [{"default": "s"}.get(w, w) for w in verify_through_command("projection")[1:]]

    def check() -> tuple[int, dict[str, Any]]:
        done = run_cli(*argv, env=env)
        assert done.returncode in (0, 1), done.stderr
        for url in secrets.values():  # the passwords, never shown
            password = conninfo_to_dict(url).get("password")
            assert not password or password not in done.stdout + done.stderr
        [report] = json.loads(done.stdout)
        return done.returncode, report

    code, report = check()
    # o-0..o-9, o-huge and o-banned; quarantined: those two and the event without an id.
    assert code == 0, report
    assert (report["expected"], report["found"], report["missing"]) == (12, 10, 0)
    assert (report["quarantined"], report["not_in_outbox"]) == (3, 0)

    placed = db.execute(
        "SELECT transaction_id::text::bigint, position FROM outbox "
        "WHERE aggregate_id = 'o-0' AND event_type = 'OrderPlaced'"
    ).fetchone()
    assert placed is not None
    db.execute(
        "UPDATE orders SET transaction_id = %s, position = %s WHERE order_id = 'o-0'", placed
    )
    db.execute(
        "INSERT INTO orders (order_id, status, transaction_id, position) "
        "VALUES ('o-ghost', 'placed', 1, 999999)"
    )  # a rolled-back transaction's
    code, report = check()
    assert code == 1
    assert (report["found"], report["missing"], report["not_in_outbox"]) == (9, 1, 1)
    assert report["examples"]["missing"][0].startswith("o-0: its row at")
    assert report["examples"]["not_in_outbox"] == [
        "o-ghost: its row at 1:999999, no committed event there"
    ]


def test_projection_from_a_new_checkpoint_fails_unless_told_to_take_the_sink_over(
    spark: SparkSession,
    published_story: set[str],
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    topic, ckpt = topic_prefix + "outbox.event.order", tmp_path / "ckpt"
    assert run_projection(spark, database_url, kafka_bootstrap, topic, ckpt) == 15
    shutil.rmtree(ckpt)  # its batch ids start over at 0: the old markers would skip them
    db.execute("DELETE FROM orders WHERE order_id = 'o-1'")  # to see whether it is written

    query = order_projection.start(
        spark, bootstrap_servers=kafka_bootstrap, topic=topic, database_url=database_url,
        checkpoint=str(ckpt), schemas=str(REPO / "schemas"), available_now=True,
    )  # fmt: skip
    with pytest.raises(Exception, match="holds the batches of streaming query") as failed:
        query.awaitTermination(300)
    assert "--reset-sink" in str(query.exception())
    # What the job's command line shows of the failure: one line, its cause.
    assert len(str(failed.value).splitlines()) > 20
    reason = failure_reason(failed.value)
    assert re.fullmatch(r"SinkOwnedError: sink order-projection holds the batches .*", reason)
    assert "--reset-sink" in reason and "\n" not in reason
    assert db.execute("SELECT count(*) FROM orders").fetchone() == (9,)

    shutil.rmtree(ckpt)
    query = order_projection.start(
        spark, bootstrap_servers=kafka_bootstrap, topic=topic, database_url=database_url,
        checkpoint=str(ckpt), schemas=str(REPO / "schemas"), available_now=True,
        reset_sink=True,
    )  # fmt: skip
    query.awaitTermination(300)
    assert query.exception() is None
    assert db.execute("SELECT count(*) FROM orders").fetchone() == (10,)
    markers = db.execute("SELECT count(*), sum(rows) FROM spark_sink_batches").fetchone()
    assert markers == (1, 15)  # the new query's batch only


def last_batch(db: psycopg.Connection[Any]) -> int:
    exists = db.execute("SELECT to_regclass('spark_sink_batches') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return -1
    row = db.execute("SELECT coalesce(max(batch_id), -1) FROM spark_sink_batches").fetchone()
    return int(row[0]) if row else -1


def wait_until_batch_after(db: psycopg.Connection[Any], batch: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while last_batch(db) <= batch:
        assert time.monotonic() < deadline, "the driver committed no batch"
        time.sleep(0.1)


def test_driver_killed_mid_run_ends_with_the_same_result_as_a_clean_run(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    writer_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    tmp_path: Path,
) -> None:
    import os
    import random
    import signal
    import subprocess
    import sys
    import threading

    start_relay(subscribers=[sub("s", topic_prefix)])
    topic, ckpt = topic_prefix + "outbox.event.order", tmp_path / "ckpt"
    stop = threading.Event()
    written: list[int] = []
    logs: list[Path] = []

    def writer() -> None:  # orders keep arriving while drivers die
        with psycopg.connect(writer_url, autocommit=True) as conn:
            i = 0
            while not stop.is_set() and i < 400:
                payload = {"order_id": f"o-{i}", "customer_id": "c", "amount_cents": i}
                outbox.append(conn, aggregate_type="order", aggregate_id=f"o-{i}",
                              event_type="OrderPlaced", payload=payload)  # fmt: skip
                if i % 3 == 0:
                    outbox.append(conn, aggregate_type="order", aggregate_id=f"o-{i}",
                                  event_type="OrderShipped",
                                  payload={"order_id": f"o-{i}", "carrier": "ups"})  # fmt: skip
                written.append(i)
                i += 1
                time.sleep(0.05)

    def driver(*extra: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "spark_jobs.order_projection",
                "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                "--database-url", database_url, "--checkpoint", str(ckpt),
                "--schemas", str(REPO / "schemas"), "--max-offsets-per-trigger", "60",
                *extra]  # fmt: skip
        logs.append(tmp_path / f"driver-{time.monotonic_ns()}.log")
        log = logs[-1].open("wb")
        # Its own process group: kill -9 takes the JVM down with the Python driver.
        return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log, start_new_session=True)

    feeder = threading.Thread(target=writer, daemon=True)
    feeder.start()
    rng = random.Random(7)
    kills = 0
    try:
        for _ in range(3):
            before = last_batch(db)
            proc = driver()
            # Die mid-stream: once this driver has committed a batch, at a random moment.
            wait_until_batch_after(db, before, timeout=120)
            time.sleep(rng.uniform(0.1, 2.0))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    finally:
        stop.set()
        feeder.join(30)
    wait_caught_up(db, "s", timeout=60)
    last = driver("--available-now")
    assert last.wait(timeout=300) == 0
    # Its run, in one line: what it read and wrote, and that it quarantined nothing.
    summary = r"order_projection: \d+ batch(?:es)?.*, \d+ rows in, \d+ rows out, 0 quarantined"
    assert re.search(rf"^{summary}$", logs[-1].read_text(), re.M), logs[-1].read_text()[-3000:]

    expected = sorted(
        (f"o-{i}", "c", i, "shipped" if i % 3 == 0 else "placed", "ups" if i % 3 == 0 else None)
        for i in written
    )
    rows = db.execute(
        "SELECT order_id, customer_id, amount_cents, status, carrier FROM orders"
    ).fetchall()
    assert kills == 3 and len(written) > 100
    assert sorted(rows) == expected
    batches = db.execute("SELECT sum(rows) FROM spark_sink_batches").fetchone()
    assert batches == (len(written) + len([i for i in written if i % 3 == 0]),)


@pytest.fixture
def published_story(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> set[str]:
    """The order story, published by a relay; the message ids."""
    start_relay(subscribers=[sub("s", topic_prefix)])
    write_order_story(writer_db, outbox)
    wait_caught_up(db, "s", timeout=60)
    return {str(r[0]) for r in db.execute("SELECT message_id FROM outbox").fetchall()}


def test_archive_holds_every_event_once_partitioned_by_date(
    spark: SparkSession,
    published_story: set[str],
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    from spark_jobs import archive

    ids = published_story
    path, ckpt = tmp_path / "archive", tmp_path / "ckpt"
    query = archive.start(
        spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + r".*",
        path=str(path), checkpoint=str(ckpt), schemas=str(REPO / "schemas"), available_now=True,
    )  # fmt: skip
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    archived = spark.read.parquet(str(path))
    assert sorted(r.message_id for r in archived.collect()) == sorted(ids)
    assert archived.where("error IS NOT NULL").count() == 0
    assert [p.name for p in path.glob("date=*")]  # partitioned by date


@pytest.mark.parametrize("job", ["order_projection", "window_average"])
def test_jobs_read_the_database_url_from_the_environment(
    job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Secrets stay out of argv (`ps`, pod specs): RELAY_DATABASE_URL or a _FILE, as the
    relay reads its own; a flag still wins."""
    import importlib

    module = importlib.import_module(f"spark_jobs.{job}")
    seen: list[str] = []

    class Query:
        recentProgress: tuple[Any, ...] = ()

        def awaitTermination(self, timeout: float) -> bool:
            return True

    def start(spark: Any, **kwargs: Any) -> Query:
        seen.append(kwargs["database_url"])
        return Query()

    monkeypatch.setattr(module, "job_session", lambda name, debug: None)
    monkeypatch.setattr(module, "start", start)
    argv = ["--bootstrap-servers", "k:9092", "--checkpoint", str(tmp_path / "c")]
    argv += ["--topics", "a,b"] if job == "window_average" else []
    monkeypatch.delenv("RELAY_DATABASE_URL", raising=False)
    monkeypatch.delenv("RELAY_DATABASE_URL_FILE", raising=False)

    with pytest.raises(SystemExit) as missing:
        module.main(argv)
    assert missing.value.code == 2
    assert "RELAY_DATABASE_URL_FILE" in capsys.readouterr().err

    secret = tmp_path / "database-url"
    secret.write_text("postgresql://job:from-file@db/app\n")
    monkeypatch.setenv("RELAY_DATABASE_URL_FILE", str(secret))
    module.main(argv)
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://job:from-env@db/app")
    module.main(argv)
    module.main([*argv, "--database-url", "postgresql://job:from-flag@db/app"])
    assert seen == [
        "postgresql://job:from-file@db/app",
        "postgresql://job:from-env@db/app",
        "postgresql://job:from-flag@db/app",
    ]

    monkeypatch.delenv("RELAY_DATABASE_URL")
    monkeypatch.setenv("RELAY_DATABASE_URL_FILE", str(tmp_path / "absent"))
    with pytest.raises(SystemExit):
        module.main(argv)
    assert "cannot read" in capsys.readouterr().err


def test_archive_refuses_its_folder_with_a_new_checkpoint(
    spark: SparkSession,
    published_story: set[str],
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    from spark_jobs import archive

    path, ckpt = tmp_path / "archive", tmp_path / "ckpt"
    run = dict(spark=spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + ".*",
               path=str(path), checkpoint=str(ckpt), schemas=str(REPO / "schemas"),
               available_now=True)  # fmt: skip
    archive.start(**run).awaitTermination(300)  # type: ignore[arg-type]
    shutil.rmtree(ckpt)

    with pytest.raises(archive.ReusedArchivePathError, match="Use a new --path"):
        archive.start(**run)  # type: ignore[arg-type]
    assert spark.read.parquet(str(path)).count() == len(published_story)


def verify_through_command(sink: str = "archive") -> list[str]:
    """docs/spark.md's ``verify --through SINK`` line, as written there."""
    text = (REPO / "docs" / "spark.md").read_text()
    section = text[text.index("## Checking the archive against the outbox") :]
    block = section[section.index("```bash\n") : section.index("```\n\n")]
    [line] = [
        line
        for line in block.splitlines()
        if line.startswith(f"outbox-relay verify --through {sink} ")
    ]
    return shlex.split(line)


def test_verify_through_the_archive_counts_only_the_files_its_log_lists(
    spark: SparkSession,
    published_story: set[str],
    kafka_bootstrap: str,
    topic_prefix: str,
    relay_url: str,
    tmp_path: Path,
) -> None:
    """Clean after a run; still clean with a crashed batch's leftover file (rows again,
    not in ``_spark_metadata``); the same file listed in the log: those rows twice."""
    from spark_jobs import archive

    path = tmp_path / "archive"
    archive.start(
        spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + ".*",
        path=str(path), checkpoint=str(tmp_path / "ckpt"), schemas=str(REPO / "schemas"),
        available_now=True,
    ).awaitTermination(300)  # fmt: skip
    secret = tmp_path / "database-url"
    secret.write_text(relay_url)
    argv = [
        {"/data/outbox-archive": str(path), "default": "s"}.get(w, w)
        for w in verify_through_command()[1:]
    ]

    def check() -> tuple[int, dict[str, Any]]:
        done = run_cli(*argv, env={"RELAY_DATABASE_URL_FILE": str(secret)})
        assert done.returncode in (0, 1), done.stderr
        [report] = json.loads(done.stdout)
        return done.returncode, report

    code, report = check()
    assert code == 0, report
    assert (report["expected"], report["found"]) == (len(published_story), len(published_story))
    first = sorted(path.glob("date=*/*.parquet"))[0]
    leftover = first.with_name("part-99999-crashed.c000.snappy.parquet")
    shutil.copy(first, leftover)
    assert check() == (0, report)  # not in the log: not the archive's
    rows = len(spark.read.parquet(str(leftover)).collect())
    log = path / "_spark_metadata"
    batch = max(int(p.name.removesuffix(".compact")) for p in log.iterdir() if p.name[0].isdigit())
    entry = {"path": leftover.as_uri(), "size": 1, "isDir": False, "modificationTime": 0,
             "blockReplication": 1, "blockSize": 1, "action": "add"}  # fmt: skip
    (log / str(batch + 1)).write_text("v1\n" + json.dumps(entry))
    code, report = check()
    assert code == 1
    assert (report["twice"], report["missing"], report["not_in_outbox"]) == (rows, 0, 0)
    assert report["examples"]["twice"][0].endswith("(2 times)")


def test_archive_backfill_reads_exactly_the_offset_range_once(
    spark: SparkSession,
    published_story: set[str],
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    import json

    from confluent_kafka import Consumer, TopicPartition

    from spark_jobs import archive

    topic = topic_prefix + "outbox.event.order"
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "backfill-test"})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    ends = {str(p): consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[1]
            for p in partitions}  # fmt: skip
    consumer.close()
    placed = published_story
    for i in range(3):  # after the range's end: not backfilled
        outbox.append(writer_db, aggregate_type="order", aggregate_id=f"late-{i}",
                      event_type="OrderPlaced",
                      payload={"order_id": f"late-{i}", "customer_id": "c", "amount_cents": 1})  # fmt: skip
    wait_caught_up(db, "s", timeout=60)

    path = tmp_path / "backfill"
    run = dict(spark=spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic),
               path=str(path), schemas=str(REPO / "schemas"),
               ending_offsets=json.dumps({topic: ends}))  # fmt: skip
    archive.backfill(**run)  # type: ignore[arg-type]

    archived = spark.read.parquet(str(path))
    assert sorted(r.message_id for r in archived.collect()) == sorted(placed)
    assert archived.where("error IS NOT NULL").count() == 0
    with pytest.raises(Exception, match="already exists"):
        archive.backfill(**run)  # type: ignore[arg-type]
    assert spark.read.parquet(str(path)).count() == len(placed)


def test_archive_of_the_wrong_format_keeps_every_value_and_says_so_at_its_first_batch(
    spark: SparkSession,
    published_story: set[str],
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Told JSON where the relay published Avro: nothing decodes, but every record is
    archived with its raw value (nothing unrecoverable) and an ERROR gives the counts."""
    from spark_jobs import archive
    from spark_jobs.job import DecodingAlarm, await_query
    from spark_jobs.run_summary import ArchiveSummary

    alarm = DecodingAlarm("archive")
    spark.streams.addListener(alarm)
    try:
        path = tmp_path / "archive"
        query = archive.start(
            spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + ".*",
            path=str(path), checkpoint=str(tmp_path / "ckpt"), schemas=str(REPO / "schemas"),
            value_format="json", available_now=True,
        )  # fmt: skip
        summary = ArchiveSummary("archive")
        await_query(query, summary)
        deadline = time.monotonic() + 60  # listeners hear of progress asynchronously
        while "cannot be decoded" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        spark.streams.removeListener(alarm)
    [alarmed] = [r for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert alarmed.levelname == "ERROR"
    assert alarmed.getMessage().startswith("archive: 15 of the first 15 records cannot be decoded")
    archived = spark.read.parquet(str(path)).collect()
    assert sorted(r.message_id for r in archived) == sorted(published_story)
    assert all(r.payload is None and r.error for r in archived)
    assert all(bytes(r.value).startswith(b"\xc3\x01") for r in archived)  # recoverable
    # The run's line: every record archived, each of them the archive's quarantine.
    assert re.fullmatch(
        r"archive: \d+ batch(es)?, 15 rows in, 15 rows out, 15 quarantined", summary.line()
    ), summary.line()


@pytest.mark.registry
@pytest.mark.timeout(1800)  # the registry's start and a Spark session, on 2 busy cores
def test_jobs_read_the_registry_format_every_event_exactly_once(
    spark: SparkSession,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    schema_registry: str,
    tmp_path: Path,
) -> None:
    """Issue #32: a relay publishes avro-registry, as a subscriber configures it; the
    projection and the archive read each event once. OrderPlaced and OrderShipped share
    the topic's subject: the latest is from_avro's, the other decoded by its id."""
    from spark_jobs import archive
    from spark_jobs.registry_schemas import RegistryAccess, planned_schemas

    start_relay(
        schema_registry_url=schema_registry,
        subscribers=[sub("reg", topic_prefix, value_format="avro-registry")],
    )
    write_order_story(writer_db, outbox)
    wait_caught_up(db, "reg", timeout=120)
    topic, access = topic_prefix + "outbox.event.order", RegistryAccess(schema_registry)
    assert len(planned_schemas(access, "avro-registry", topic)) == 1

    query = order_projection.start(
        spark, bootstrap_servers=kafka_bootstrap, topic=topic, database_url=database_url,
        checkpoint=str(tmp_path / "ckpt"), schemas=str(REPO / "schemas"),
        value_format="avro-registry", registry=access, available_now=True,
    )  # fmt: skip
    assert query.awaitTermination(1200), "the query did not finish"  # a loaded machine
    assert query.exception() is None, query.exception()
    expected = [
        (f"o-{i}", f"c-{i % 3}", 100 * i, "shipped" if i % 2 == 0 else "placed",
         "dhl" if i % 2 == 0 else None)
        for i in range(10)
    ]  # fmt: skip
    rows = db.execute("SELECT order_id, customer_id, amount_cents, status, carrier FROM orders")
    assert sorted(rows.fetchall()) == sorted(expected)
    assert db.execute("SELECT sum(rows) FROM spark_sink_batches").fetchone() == (15,)

    path = tmp_path / "archive"
    query = archive.start(
        spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + ".*",
        path=str(path), checkpoint=str(tmp_path / "archive-ckpt"),
        schemas=str(REPO / "schemas"), registry=access, available_now=True,
    )  # fmt: skip
    assert query.awaitTermination(1200), "the query did not finish"  # a loaded machine
    assert query.exception() is None, query.exception()
    archived = spark.read.parquet(str(path)).collect()
    ids = {str(r[0]) for r in db.execute("SELECT message_id FROM outbox").fetchall()}
    assert sorted(r.message_id for r in archived) == sorted(ids)  # each once
    assert [r.error for r in archived if r.error] == []
    assert {bytes(r.value)[:1] for r in archived} == {b"\x00"}  # the wire format
    assert len({bytes(r.value)[1:5] for r in archived}) == 2  # two schema ids


def test_the_registry_comes_from_the_relays_settings_and_its_secrets_stay_masked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--format avro-registry` needs schema_registry_url, read as the relay reads it
    (RELAY_SCHEMA_REGISTRY_*); the job is handed it, and logs it without the password."""
    from spark_jobs import archive

    seen: list[Any] = []

    class Query:
        recentProgress: tuple[Any, ...] = ()

        def awaitTermination(self, timeout: float) -> bool:
            return True

    def start(spark: Any, **kwargs: Any) -> Query:
        seen.append(kwargs["registry"])
        return Query()

    monkeypatch.setattr(archive, "job_session", lambda name, debug, **session: None)
    monkeypatch.setattr(archive, "run", lambda name, debug, body, summary=None: body())
    monkeypatch.setattr(archive, "start", start)
    for name in ("URL", "USER", "PASSWORD", "CA"):
        monkeypatch.delenv(f"RELAY_SCHEMA_REGISTRY_{name}", raising=False)
    argv = ["--bootstrap-servers", "k:9092", "--path", str(tmp_path / "a"),
            "--checkpoint", str(tmp_path / "c"), "--format", "avro-registry"]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        archive.main(argv)
    assert refused.value.code == 2
    assert "RELAY_SCHEMA_REGISTRY_URL" in capsys.readouterr().err

    monkeypatch.setenv("RELAY_SCHEMA_REGISTRY_URL", "https://registry.example:8081")
    monkeypatch.setenv("RELAY_SCHEMA_REGISTRY_USER", "spark")
    monkeypatch.setenv("RELAY_SCHEMA_REGISTRY_PASSWORD", "hunter2-registry")
    with caplog.at_level("INFO"):
        archive.main(argv)
    [access] = seen
    assert (access.url, access.user, access.password) == (
        "https://registry.example:8081", "spark", "hunter2-registry"
    )  # fmt: skip
    assert "hunter2-registry" not in caplog.text + repr(access)
    assert "registry.example" in caplog.text


REFUSED_BEFORE_SPARK = {
    "a schemas folder that is not there": (
        "order_projection", ["--checkpoint", "ckpt", "--schemas", "absent"],
        r"--schemas: schemas folder \S*/absent does not exist",
    ),
    "--format avro with no schemas folder": (
        "archive", ["--path", "archive", "--checkpoint", "ckpt", "--format", "avro"],
        r"--format avro needs the writer schemas: --schemas DIR, or the relay's schemas_dir .*",
    ),
    "a checkpoint that is a file": (
        "window_average", ["--checkpoint", "a-file", "--topics", "a,b"],
        r"--checkpoint a-file: a file, not a folder",
    ),
    "a database URL libpq cannot parse": (
        "order_projection",
        ["--checkpoint", "ckpt", "--database-url", "postgresql://job:hunter2@db:port/app"],
        r"the database URL cannot be used: the port is not a number; .*",
    ),
    "a backfill into a folder that exists": (
        "archive", ["--backfill", "--path", "a-folder"],
        r"--path a-folder: exists already \(a backfill writes a new folder\)",
    ),
    "offsets that are not Spark's": (
        "archive", ["--backfill", "--path", "new", "--ending-offsets", '{"t": {0: 1}}'],
        r"--ending-offsets: not earliest, latest or JSON \(.*\)",
    ),
}  # fmt: skip


def spark_job_without_java(
    module: str, argv: list[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``python -m spark_jobs.<module>`` from ``cwd``, where Spark cannot start: JAVA_HOME
    names no Java, so a job that got as far as starting Spark says so."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env |= {"JAVA_HOME": str(cwd / "no-java"), "RELAY_DATABASE_URL": "postgresql://job@db/app"}
    command = [sys.executable, "-m", f"spark_jobs.{module}", "--bootstrap-servers", "k:9092"]
    return subprocess.run(
        [*command, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("case", REFUSED_BEFORE_SPARK)
def test_a_job_refuses_bad_arguments_and_folders_before_spark_starts(
    case: str, tmp_path: Path
) -> None:
    """Issue #48: a bad folder used to fail only once Spark had started (73 s)."""
    module, argv, message = REFUSED_BEFORE_SPARK[case]
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    refused = spark_job_without_java(module, argv, tmp_path)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2, refused.stderr
    assert re.fullmatch(rf"{module}\.py: error: {message}", last), refused.stderr
    assert "JAVA_GATEWAY_EXITED" not in refused.stderr + refused.stdout  # Spark never started
    assert "hunter2" not in refused.stderr


def test_a_json_job_needs_no_schemas_folder_where_it_runs(tmp_path: Path) -> None:
    """Run from a folder without `schemas/`, a job reading JSON is not refused by its
    checks before Spark: it goes on to start Spark (which cannot start here: no Java).
    A guard on those checks; that such a job then runs is the README test's (it runs
    the jobs from outside the clone) and the projection test's (``schemas=None``)."""
    for module, argv in (
        ("order_projection", ["--checkpoint", "ckpt", "--format", "json"]),
        ("archive", ["--path", "archive", "--checkpoint", "ckpt"]),  # auto: no Avro folder
    ):
        started = spark_job_without_java(module, argv, tmp_path)
        assert started.returncode == 1, started.stderr
        last = started.stderr.strip().splitlines()[-1]
        assert "JAVA_GATEWAY_EXITED" in last and last.startswith(f"{module}: "), started.stderr
