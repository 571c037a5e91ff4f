"""Job (b) (docs/design.md §8): averages to a Kafka topic and a counter in Postgres, each
exactly once, checked after a replayed batch and after kill -9 at each crash point."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from relay.adapters.kafka.topic_reader import KafkaTopicReader
from spark_jobs import window_average
from spark_jobs.kafka_sink import KafkaBatchSink

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000  # ms, on a 5 s boundary
Window = tuple[int, float, int]  # start - T0 (ms), average, numbers


class Story:
    """Two input topics of numbers, an output topic, and the exact expected result."""

    def __init__(self, bootstrap: str) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bootstrap = bootstrap
        self.inputs = [f"numbers-{tag}-a", f"numbers-{tag}-b"]
        self.output = f"averages-{tag}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        # Readings are stamped in 2023: time-based retention would delete them within
        # minutes (a replay then finds its offsets gone), so the inputs keep everything.
        keep = {"retention.ms": "-1"}
        topics = [NewTopic(t, 2, -1, config=keep) for t in self.inputs]
        topics.append(NewTopic(self.output, 1, -1))
        for future in admin.create_topics(topics).values():
            future.result()
        self.readings = [(self.inputs[0], T0 + 700 * i, float(i)) for i in range(86)]
        self.readings += [(self.inputs[1], T0 + 1300 * i, 100.0 + i) for i in range(46)]

    def write(self) -> None:
        producer = Producer(
            {"bootstrap.servers": self.bootstrap, "transactional.id": str(uuid.uuid4())}
        )
        producer.init_transactions(30)
        producer.begin_transaction()
        for topic, ts, number in self.readings:
            producer.produce(topic, json.dumps({"value": number}).encode(), timestamp=ts)
        # Moves the watermark past every window above, which closes them.
        producer.produce(self.inputs[0], b"0", timestamp=T0 + 1_000_000)
        producer.commit_transaction(30)

    @property
    def expected(self) -> list[Window]:
        windows = []
        for start in range(-5_000, 60_000, 5_000):
            inside = [n for _, ts, n in self.readings if start <= ts - T0 < start + 10_000]
            if inside:
                windows.append((start, round(sum(inside) / len(inside), 6), len(inside)))
        return windows

    @property
    def crowded(self) -> int:
        return sum(1 for _, _, count in self.expected if count > 10)

    def averages(self) -> list[Window]:
        """Every committed record of the output topic, in topic order (read_committed)."""
        reader = KafkaTopicReader({"bootstrap.servers": self.bootstrap}, timeout=60)
        values = [json.loads(r.value or b"") for r in reader.read([self.output])]
        return [(int(datetime.fromisoformat(v["window_start"]).timestamp() * 1000) - T0,
                 round(v["average"], 6), v["numbers"]) for v in values]  # fmt: skip

    def kafka_batches(self, ckpt: Path) -> int:
        """How many batches the query of checkpoint ``ckpt`` committed to the topic."""
        query_id = json.loads((ckpt / "metadata").read_text())["id"]
        sink = KafkaBatchSink(self.bootstrap, self.output, f"window-average.{self.output}")
        try:
            return sink.committed_batches(query_id)
        finally:
            sink.close()


def counter_state(url: str) -> tuple[int, list[int]]:
    """The counter's value, and the batch ids its sink committed."""
    with psycopg.connect(url) as conn:
        value = conn.execute("SELECT coalesce(sum(value), 0) FROM window_counters").fetchone()
        batches = conn.execute(
            "SELECT batch_id FROM spark_sink_batches WHERE sink LIKE 'window-average:%' ORDER BY 1"
        ).fetchall()
    return int(value[0]) if value else 0, [b[0] for b in batches]


def spark_commits(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in (ckpt / "commits").glob("[0-9]*"))


def run_in_session(spark: SparkSession, story: Story, url: str, ckpt: Path, **options: Any) -> Any:
    """One AvailableNow run of the job in the test's session; the error it ended with."""
    query = window_average.start(
        spark, bootstrap_servers=story.bootstrap, topics=story.inputs,
        output_topic=story.output, database_url=url, checkpoint=str(ckpt),
        threshold=10, available_now=True, **options,
    )  # fmt: skip
    with contextlib.suppress(Exception):
        query.awaitTermination(300)
    return query.exception()


def test_averages_and_counter_are_exact_and_a_replayed_batch_writes_nothing(
    spark: SparkSession, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    story = Story(kafka_bootstrap)
    story.write()
    ckpt = tmp_path / "ckpt"

    def run() -> None:
        error = run_in_session(spark, story, database_url, ckpt)
        assert error is None, error

    run()
    assert sorted(story.averages()) == story.expected
    assert counter_state(database_url)[0] == story.crowded > 3  # the test means something
    commits = spark_commits(ckpt)
    (ckpt / "commits" / str(commits[-1])).unlink()  # a crash after both sinks committed
    (ckpt / "commits" / f".{commits[-1]}.crc").unlink(missing_ok=True)
    run()
    assert sorted(story.averages()) == story.expected
    assert counter_state(database_url) == (story.crowded, commits)
    assert story.kafka_batches(ckpt) == len(commits)


def driver(story: Story, url: str, ckpt: Path, log: Path, *crash: str) -> subprocess.Popen[bytes]:
    module = (
        ["tests.acceptance.window_average_crash", *crash]
        if crash
        else ["spark_jobs.window_average"]
    )
    argv = [sys.executable, "-m", *module, "--bootstrap-servers", story.bootstrap,
            "--topics", ",".join(story.inputs), "--output-topic", story.output,
            "--database-url", url, "--checkpoint", str(ckpt), "--threshold", "10",
            "--max-offsets-per-trigger", "40", "--available-now",
            # Batches of 40 offsets mix the topics' times unevenly (topic b's numbers are
            # sparser): the watermark must not drop any, or no result would be exact.
            "--lateness", "2 minutes"]  # fmt: skip
    out = log.open("ab")
    # Its own process group: kill -9 takes the JVM down with the Python driver.
    return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=out, start_new_session=True)


@pytest.mark.parametrize("point", ["A", "B", "C", "D"])
def test_kill_9_at_each_crash_point_ends_in_the_exact_state(
    point: str, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    story = Story(kafka_bootstrap)
    story.write()
    ckpt, log = tmp_path / "ckpt", tmp_path / "driver.log"

    crashed = driver(story, database_url, ckpt, log, point)
    assert crashed.wait(timeout=300) == -signal.SIGKILL, log.read_text()[-3000:]

    # The state at the crash is the one the point names.
    counted, marked = counter_state(database_url)
    committed = spark_commits(ckpt)
    batch = len(committed)  # the batch that was running
    if point == "D":
        assert batch == 1 and story.kafka_batches(ckpt) == 1 and marked == [0]
        assert not (ckpt / "state" / "0" / "0" / "2.delta").exists()  # no state saved
    if point == "C":
        assert story.kafka_batches(ckpt) == batch and marked == committed
        assert (ckpt / "state" / "0" / "0" / f"{batch + 1}.delta").exists()  # state saved
    if point == "A":
        assert story.kafka_batches(ckpt) == batch + 1 and marked == committed
        assert story.averages() and counted == 0  # averages out, the counter not yet
    if point == "B":
        assert story.kafka_batches(ckpt) == batch + 1 and marked == [*committed, batch]
    assert (ckpt / "offsets" / str(batch)).exists()  # Spark replays this batch

    resumed = driver(story, database_url, ckpt, log)
    assert resumed.wait(timeout=300) == 0, log.read_text()[-3000:]

    batches = spark_commits(ckpt)
    assert sorted(story.averages()) == story.expected  # each average once
    assert counter_state(database_url) == (story.crowded, batches)  # incremented once
    assert story.kafka_batches(ckpt) == len(batches) == batches[-1] + 1


def test_a_new_checkpoint_fails_before_writing_unless_told_to_take_the_sinks_over(
    spark: SparkSession, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    import shutil

    story = Story(kafka_bootstrap)
    story.write()
    ckpt = tmp_path / "ckpt"

    def run(**options: Any) -> Any:
        return run_in_session(spark, story, database_url, ckpt, **options)

    assert run() is None
    shutil.rmtree(ckpt)  # a reset checkpoint: a new query, batch ids from 0 again

    refused = str(run())
    assert "holds the batches of streaming query" in refused and "--reset-sink" in refused
    assert sorted(story.averages()) == story.expected  # nothing written twice
    assert counter_state(database_url)[0] == story.crowded

    shutil.rmtree(ckpt)
    assert run(reset_sink=True) is None  # a reprocess: everything again, on top
    assert sorted(story.averages()) == sorted(story.expected * 2)
    counted, marked = counter_state(database_url)
    assert counted == 2 * story.crowded and marked == spark_commits(ckpt)


@pytest.mark.timeout(1200)  # two runs of the query, on 2 busy cores
def test_inputs_that_are_not_numbers_are_reported_and_quarantined_exactly_once(
    spark: SparkSession,
    database_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Avro values where the job expects JSON numbers, and numbers that are not finite:
    an ERROR that says how many of the first records were not numbers, and each of them
    quarantined once, with its reason, when its last window closes (issue #48)."""
    import time

    from spark_jobs.job import DecodingAlarm
    from spark_jobs.run_summary import RunSummary

    story = Story(kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(9):
        producer.produce(story.inputs[i % 2], b"\xc3\x01\x00\x01avro" + bytes([i]), timestamp=T0)
    producer.produce(story.inputs[0], b'{"value": 1}', timestamp=T0)
    producer.produce(story.inputs[1], b'{"value": "NaN"}', timestamp=T0 + 1000)
    producer.produce(story.inputs[1], b"1e999", timestamp=T0 + 6000)  # beyond a double
    producer.produce(story.inputs[0], b"0", timestamp=T0 + 1_000_000)  # closes the windows
    producer.flush(30)
    ckpt = tmp_path / "ckpt"
    alarm = DecodingAlarm("window_average")
    spark.streams.addListener(alarm)
    summary = RunSummary("window_average")
    try:
        assert run_in_session(spark, story, database_url, ckpt, summary=summary) is None
        deadline = time.monotonic() + 60  # listeners hear of progress asynchronously
        while "cannot be decoded" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        spark.streams.removeListener(alarm)
    [alarmed] = [r for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert alarmed.levelname == "ERROR"
    message = alarmed.getMessage()
    assert message.startswith("window_average: 11 of the first 13 records cannot be decoded")
    assert "(not a finite number: 1e999)" in message

    def quarantined() -> list[tuple[Any, ...]]:
        with psycopg.connect(database_url) as conn:
            return conn.execute(
                'SELECT topic, partition, "offset", error FROM spark_corrupt_records '
                "WHERE sink = 'window-average:crowded_windows' AND topic = ANY(%s)",
                (story.inputs,),
            ).fetchall()

    reasons = sorted(["not a number: "] * 9 + ['not a finite number: {"value": "NaN"}',
                      "not a finite number: 1e999"])  # fmt: skip
    rows = quarantined()
    assert sorted(e if "finite" in e else e[:14] for *_, e in rows) == reasons
    assert len({tuple(place) for *place, _ in rows}) == len(rows)  # each once
    assert sorted(story.averages()) == [(-5000, 1.0, 1), (0, 1.0, 1)]
    assert (summary.rows_out, summary.quarantined) == (2, 11)  # what the run's line says

    commits = spark_commits(ckpt)  # a crash before Spark logged the last batch
    (ckpt / "commits" / str(commits[-1])).unlink()
    (ckpt / "commits" / f".{commits[-1]}.crc").unlink(missing_ok=True)
    replay = RunSummary("window_average")
    assert run_in_session(spark, story, database_url, ckpt, summary=replay) is None
    assert sorted(quarantined()) == sorted(rows)  # nothing twice
    assert (replay.rows_out, replay.quarantined, replay.replayed) == (0, 0, 1)
    assert sorted(story.averages()) == [(-5000, 1.0, 1), (0, 1.0, 1)]
