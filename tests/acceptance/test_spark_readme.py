"""The Spark jobs run exactly as the README's Spark page, docs/spark.md, shows them (the
command lines are read from it, so the two cannot drift), against a relay with its defaults (the default
subscriber, JSON values), on a broker of this module's own: the README's topic names
are unprefixed. The same broker has a SASL_PLAINTEXT (SCRAM-SHA-256) listener, which
the jobs reach with the relay's Kafka settings."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pytest.importorskip("pyspark")

from relay import Outbox
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalKafka
from tests.support import wait_caught_up

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]
SCRAM_USER, SCRAM_PASSWORD = "spark-job", f"scram-{uuid.uuid4().hex}"
T0 = 1_700_000_000_000  # ms, on a 5 s boundary
SPARK_PAGE = REPO / "docs" / "spark.md"  # the README's Spark section, moved (#50 item 8)
WAIT_S = 600.0  # a Spark driver's start and first batches, on a busy 2-core machine


def readme_commands(
    after: str = "# Spark Structured Streaming",
    command: tuple[str, ...] = (".venv/bin/python", "-m"),
    page: Path = SPARK_PAGE,
) -> tuple[dict[str, str], list[list[str]]]:
    """The environment the ``page``'s first bash block ``after`` a heading (or a
    sentence) exports, and its command lines that start with ``command`` (every one,
    in order, with ``()``)."""
    text = page.read_text()
    section = text[text.index(after) :]
    block = section[section.index("```bash\n") + len("```bash\n") :]
    block = block[: block.index("```")].replace("\\\n", " ")
    env, commands = {}, []
    for line in block.splitlines():
        # A comment starts where a word does, as in bash: `x.tar.gz#environment` is a word.
        words = shlex.split(re.sub(r"(^|\s)#.*", "", line))
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            env[name] = value
        elif words and tuple(words[: len(command)]) == command:
            commands.append(words)
    return env, commands


def readme_quarantine_query() -> str:
    """The Spark page's query of the quarantined events."""
    text = SPARK_PAGE.read_text()
    section = text[text.index("## Events a job cannot apply") :]
    return section[section.index("```sql\n") + len("```sql\n") :].split("```")[0]


def readme_command(module: str, *, backfill: bool = False) -> list[str]:
    [argv] = [c for c in readme_commands()[1] if c[2] == module and ("--backfill" in c) == backfill]
    return argv


@pytest.fixture(autouse=True)
def no_job_left() -> Iterator[None]:
    yield
    while Job.started:
        proc = Job.started.pop().proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    kafka = LocalKafka(
        tmp_path_factory.mktemp("readme-kafka"), scram_users={SCRAM_USER: SCRAM_PASSWORD}
    )
    with kafka:
        yield kafka


class Job:
    """A job's driver, run as the README shows (``.venv/bin/python`` is this one), or
    any other command (``spark-submit``)."""

    started: ClassVar[list[Job]] = []

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        Job.started.append(self)
        with log.open("ab") as out:
            # Its own process group, like a shell's job: Ctrl-C goes to the group. Not
            # from the clone: a job must not need the folder it starts in (schemas/).
            python = argv[0] == ".venv/bin/python"
            self.proc = subprocess.Popen(
                [sys.executable, *argv[1:]] if python else argv, cwd=log.parent, env={**os.environ, **env},
                stdout=out, stderr=out, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert self.proc.poll() is None, self.output()[-3000:]
            assert time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(1)

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the whole process group, as a terminal sends it."""
        before = len(self.output().splitlines())
        os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(timeout=120)
        after = self.output().splitlines()[before:]
        assert not [line for line in after if "Traceback" in line or "py4j" in line], after
        return code


def substituted(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """``argv`` with each word that starts with a key of ``replacements`` started anew."""
    out = []
    for word in argv:
        old = next((o for o in replacements if word.startswith(o)), "")
        out.append(replacements[old] + word[len(old) :] if old else word)
    return out


def relay_with_defaults(database_url: str, bootstrap: str) -> Relay:
    """A relay as `outbox-relay run` starts it with no config: no schemas, so its default
    subscriber publishes JSON to outbox.event.<aggregate_type>."""
    settings = load_settings(
        database_url=database_url, bootstrap_servers=bootstrap, poll_interval=0.2,
        heartbeat_interval=0.3, session_timeout=3.0, metrics_port=0,
    )  # fmt: skip
    relay = Relay(settings)
    relay.start()
    return relay


def publish_with_defaults(
    db: psycopg.Connection[Any], relay_url: str, bootstrap: str, write: Callable[[], None]
) -> None:
    """``write`` the app's events, and wait until a relay with its defaults published them."""
    relay = relay_with_defaults(relay_url, bootstrap)
    try:
        write()
        wait_caught_up(db, "default", timeout=WAIT_S)
    finally:
        relay.stop()


def write_orders(db: psycopg.Connection[Any], outbox: Outbox) -> None:
    for i in range(10):
        payload = {"order_id": f"o-{i}", "customer_id": f"c-{i % 3}", "amount_cents": 100 * i}
        outbox.append(db, aggregate_type="order", aggregate_id=f"o-{i}",
                      event_type="OrderPlaced", payload=payload)  # fmt: skip
    # Legal for a relay without schemas (an app that writes JSON only, unvalidated), but
    # no order the read model can hold: quarantined, not a wedge (issue #48).
    Outbox(None).append(db, aggregate_type="order", aggregate_id="no-id",
                        event_type="OrderPlaced", payload={"customer_id": "c-1"})  # fmt: skip
    for i in range(0, 10, 2):
        outbox.append(db, aggregate_type="order", aggregate_id=f"o-{i}",
                      event_type="OrderShipped", payload={"order_id": f"o-{i}", "carrier": "dhl"})  # fmt: skip


def write_numbers(bootstrap: str, inputs: list[str], conf: dict[str, Any] | None = None) -> None:
    """JSON numbers as the relay publishes a payload ``{"value": n}``, at set times."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **(conf or {})})
    topics = [NewTopic(t, 1, -1, config={"retention.ms": "-1"}) for t in inputs]
    for future in admin.create_topics(topics).values():
        future.result()
    producer = Producer({"bootstrap.servers": bootstrap, **(conf or {})})
    for i in range(8):  # 0, 1 ... at T0 + 0 s, 1 s ...; 100, 101 ... likewise
        for offset, topic in enumerate(inputs):
            producer.produce(
                topic, json.dumps({"value": 100 * offset + i}), timestamp=T0 + 1000 * i
            )
    producer.produce(inputs[0], b'{"value": 0}', timestamp=T0 + 60_000)  # closes the windows
    producer.flush(30)


# Windows of 10 s every 5 s: [-5, 5) holds 0..4 and 100..104, [0, 10) all, [5, 15) 5..7.
EXPECTED_AVERAGES = [(-5000, 52.0, 10), (0, 53.5, 16), (5000, 56.0, 6)]


def averages(bootstrap: str, topic: str, conf: dict[str, Any] | None = None) -> list[Any]:
    reader = KafkaTopicReader({"bootstrap.servers": bootstrap, **(conf or {})}, timeout=30)
    return [json.loads(r.value or b"") for r in reader.read([topic])]


def as_expected(values: list[Any]) -> list[tuple[int, float, int]]:
    from datetime import datetime

    return sorted(
        (int(datetime.fromisoformat(v["window_start"]).timestamp() * 1000) - T0,
         round(v["average"], 6), v["numbers"])
        for v in values if v["window_start"] < "2023-11-14T22:14"
    )  # fmt: skip


@pytest.mark.timeout(4 * WAIT_S)
def test_each_job_runs_as_the_readme_shows_against_the_relays_defaults(
    broker: LocalKafka,
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_url: str,
    tmp_path: Path,
) -> None:
    bootstrap = broker.bootstrap_servers
    # The relay and the app as production runs them; the sinks' tables are the test's own.
    publish_with_defaults(db, relay_url, bootstrap, lambda: write_orders(writer_db, outbox))
    ids = {str(r[0]) for r in db.execute("SELECT message_id FROM outbox").fetchall()}
    exported, _ = readme_commands()
    secret = tmp_path / "database-url"
    secret.write_text(database_url)
    env = {name: str(secret) for name in exported}  # RELAY_DATABASE_URL_FILE
    assert env.keys() == {"RELAY_DATABASE_URL_FILE"}
    paths = {"127.0.0.1:9092": bootstrap, "/var/lib/spark/": f"{tmp_path}/", "/tmp/": f"{tmp_path}/",
             "/data/": f"{tmp_path}/"}  # fmt: skip
    log = tmp_path / "jobs.log"

    # (a) The order projection, from the JSON records.
    job = Job(substituted(readme_command("spark_jobs.order_projection"), paths), env, log)

    def projected() -> bool:
        exists = db.execute("SELECT to_regclass('orders') IS NOT NULL").fetchone()
        shipped = "SELECT count(*) FROM orders WHERE status = 'shipped' AND carrier = 'dhl'"
        return bool(exists and exists[0]) and db.execute(shipped).fetchone() == (5,)

    job.wait_for(projected)
    assert job.interrupt() == 130
    rows = db.execute("SELECT order_id, customer_id, amount_cents, status FROM orders").fetchall()
    assert sorted(rows) == sorted(
        (f"o-{i}", f"c-{i % 3}", 100 * i, "shipped" if i % 2 == 0 else "placed") for i in range(10)
    )
    # Batches and rows in: those Spark finished; Ctrl-C may stop one after its sink
    # committed (the next run replays it, and the sink skips it).
    summary = r"order_projection: \d+ batch(?:es)?, \d+ rows in, 15 rows out, 1 quarantined"
    assert re.search(rf"^{summary}$", job.output(), re.M), job.output()[-3000:]
    # The README's query of what the jobs quarantined.
    [quarantined] = db.execute(readme_quarantine_query()).fetchall()
    assert quarantined[:2] == ("order-projection", "outbox.event.order")
    assert quarantined[4:] == ("no-id", "no order_id")

    # (b) The window averages: the output topic does not exist yet, the job creates it.
    argv = readme_command("spark_jobs.window_average")
    inputs = argv[argv.index("--topics") + 1].split(",")
    output = argv[argv.index("--output-topic") + 1]
    write_numbers(bootstrap, inputs)
    job = Job(substituted(argv, paths), env, log)
    job.wait_for(lambda: output in AdminClient({"bootstrap.servers": bootstrap}).list_topics(
        timeout=10).topics and len(as_expected(averages(bootstrap, output))) == 3)  # fmt: skip
    assert job.interrupt() == 130
    summary = r"window_average: \d+ batch(?:es)?, \d+ rows in, 3 rows out, 0 quarantined"
    assert re.search(rf"^{summary}$", job.output(), re.M), job.output()[-3000:]
    values = averages(bootstrap, output)
    assert as_expected(values) == EXPECTED_AVERAGES
    first = min(values, key=lambda v: str(v["window_start"]))
    assert first["window_start"] == "2023-11-14T22:13:15+00:00"  # UTC, with its offset
    assert first["window_end"] == "2023-11-14T22:13:25+00:00"

    # (c) The archive: every event, its JSON payload decoded, its raw value kept.
    argv = substituted(readme_command("spark_jobs.archive"), paths)
    archive = Path(argv[argv.index("--path") + 1])
    job = Job(argv, env, log)
    job.wait_for((archive / "_spark_metadata" / "0").exists)
    assert job.interrupt() == 130
    summary = r"archive: \d+ batch(?:es)?, (\d+) rows in, \1 rows out, 0 quarantined"
    assert re.search(rf"^{summary}$", job.output(), re.M), job.output()[-3000:]
    assert_archived(archive, ids)

    # The backfill, up to the ends the topic has now.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "readme"})
    topic = "outbox.event.order"
    ends = {str(p): consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[1]
            for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions}  # fmt: skip
    consumer.close()
    argv = substituted(readme_command("spark_jobs.archive", backfill=True), paths)
    argv[argv.index("--ending-offsets") + 1] = json.dumps({topic: ends})
    job = Job(argv, env, log)
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-3000:]
    assert_archived(Path(argv[argv.index("--path") + 1]), ids)
    assert "cannot be decoded" not in job.output()
    last = job.output().strip().splitlines()[-1]
    assert last == "archive: 1 batch, 16 rows in, 16 rows out, 0 quarantined", last


def assert_archived(folder: Path, ids: set[str]) -> None:
    import pyarrow.dataset as ds

    rows = ds.dataset(folder, format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted(r["message_id"] for r in rows) == sorted(ids)
    assert [r for r in rows if r["error"] is not None or r["payload"] is None] == []
    for row in rows:
        assert json.loads(row["value"]) == json.loads(row["payload"])  # the raw bytes, kept


@pytest.mark.timeout(WAIT_S)
def test_the_jobs_reach_a_sasl_cluster_with_the_relays_kafka_settings(
    broker: LocalKafka, database_url: str, tmp_path: Path
) -> None:
    """RELAY_KAFKA, as the relay reads it, reaches Spark's Kafka source (as Java client
    properties) and the job's own clients (the output topic's admin, the sink)."""
    kafka = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
             "sasl.username": SCRAM_USER, "sasl.password": SCRAM_PASSWORD}  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    inputs, output = [f"sasl-{tag}-a", f"sasl-{tag}-b"], f"sasl-{tag}-averages"
    sasl = broker.sasl_bootstrap_servers
    write_numbers(sasl, inputs, kafka)
    argv = [".venv/bin/python", "-m", "spark_jobs.window_average", "--bootstrap-servers", sasl,
            "--topics", ",".join(inputs), "--output-topic", output,
            "--checkpoint", str(tmp_path / "ckpt"), "--available-now"]  # fmt: skip
    env = {"RELAY_KAFKA": json.dumps(kafka), "RELAY_DATABASE_URL": database_url}
    job = Job(argv, env, tmp_path / "job.log")
    assert job.proc.wait(timeout=WAIT_S) == 0, job.output()[-3000:]
    assert as_expected(averages(sasl, output, kafka)) == EXPECTED_AVERAGES
    assert SCRAM_PASSWORD not in job.output()
    assert "sasl.password=**********" in job.output()  # what it connected with, masked


@pytest.mark.timeout(WAIT_S)
def test_a_missing_output_topic_fails_in_one_line_when_not_to_be_created(
    broker: LocalKafka, database_url: str, tmp_path: Path
) -> None:
    missing = f"absent-{uuid.uuid4().hex[:6]}"
    argv = [".venv/bin/python", "-m", "spark_jobs.window_average",
            "--bootstrap-servers", broker.bootstrap_servers, "--topics", "a,b",
            "--output-topic", missing, "--no-create-output-topic",
            "--checkpoint", str(tmp_path / "ckpt")]  # fmt: skip
    job = Job(argv, {"RELAY_DATABASE_URL": database_url}, tmp_path / "job.log")
    assert job.proc.wait(timeout=WAIT_S) == 1
    lines = job.output().strip().splitlines()
    assert re.fullmatch(
        rf"window_average: OutputTopicMissingError: output topic '{missing}' does not exist: "
        rf"create it \(kafka-topics.sh .*--create --topic {missing}\).*",
        lines[-1],
    ), lines
    assert not [line for line in lines if "Traceback" in line or "at org.apache" in line], lines
