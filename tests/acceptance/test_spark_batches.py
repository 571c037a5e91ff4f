"""Issue #51: the Spark jobs on a backlog: bounded micro-batches, and a Postgres sink
that never holds a whole batch on the driver."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from spark_jobs import order_projection

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]


def produce_relay_orders(bootstrap: str, topic: str, orders: int) -> int:
    """``orders`` OrderPlaced events as the relay publishes them (JSON, its headers), and
    an OrderShipped after them for every tenth, straight to Kafka (fast: tens of
    thousands); every 4,000th order is of customer ``c-banned``. Returns the events."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 2, -1)]).values():
        future.result()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    events = [("OrderPlaced", i, {"order_id": f"o-{i}", "amount_cents": i,
               "customer_id": "c-banned" if i % 4000 == 1 else f"c-{i % 7}"})
              for i in range(orders)]  # fmt: skip
    events += [("OrderShipped", i, {"order_id": f"o-{i}", "carrier": "dhl"})
               for i in range(0, orders, 10)]  # fmt: skip
    for position, (event_type, i, payload) in enumerate(events):
        headers = [("id", str(uuid.uuid4())), ("event_type", event_type),
                   ("aggregate_type", "order"), ("transaction_id", str(1000 + position)),
                   ("position", "1"), ("aggregate_version", "1")]  # fmt: skip
        producer.produce(topic, json.dumps(payload).encode(), f"o-{i}".encode(), headers=headers)
        producer.poll(0)
    assert producer.flush(60) == 0
    return len(events)


@pytest.mark.timeout(1200)  # a Spark driver of its own, on 2 busy cores
def test_projection_of_a_batch_beyond_the_drivers_result_size_limit(
    database_url: str, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Issue #51: the Postgres sink collect()ed each batch on the driver, so a batch 0 of
    a backlog was the whole topic in driver memory: with spark.driver.maxResultSize at
    1m, a batch of 88,000 events failed. It reads the batch a partition at a time now,
    and ends the same: in publication order (shipped orders keep their customer), the
    rows Postgres refuses quarantined and only those."""
    topic, orders = topic_prefix + "orders", 80_000
    events = produce_relay_orders(kafka_bootstrap, topic, orders)
    order_projection.ensure_tables(database_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE orders ADD CONSTRAINT no_banned_customers "
            "CHECK (customer_id <> 'c-banned')"
        )
    argv = [sys.executable, "-m", "spark_jobs.order_projection", "--bootstrap-servers",
            kafka_bootstrap, "--topic", topic, "--database-url", database_url,
            "--checkpoint", str(tmp_path / "ckpt"), "--format", "json", "--available-now"]  # fmt: skip
    low_limit = {**os.environ, "PYSPARK_SUBMIT_ARGS": "--conf spark.driver.maxResultSize=1m pyspark-shell"}  # fmt: skip
    run = subprocess.run(
        argv, check=False, cwd=REPO, env=low_limit, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    banned = len(range(1, orders, 4000))
    # One batch: the default limit (100,000) holds the whole backlog.
    assert run.stdout.strip().splitlines()[-1] == (
        f"order_projection: 1 batch, {events} rows in, {events - banned} rows out, "
        f"{banned} quarantined"
    )
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT count(*), count(carrier), count(*) FILTER (WHERE customer_id IS NULL) "
            "FROM orders"
        ).fetchone()
        refused = conn.execute(
            "SELECT key, error FROM spark_corrupt_records ORDER BY key"
        ).fetchall()
    # Every shipment came after its order's placing (else the guard on (transaction_id,
    # position) would have refused the placing, and its customer would be missing).
    assert rows == (orders - banned, orders // 10, 0)
    assert {key for key, _ in refused} == {f"o-{i}" for i in range(1, orders, 4000)}
    assert all("no_banned_customers" in error for _, error in refused)


def test_archive_reads_a_backlog_in_batches_of_its_limit(
    spark: SparkSession, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Issue #51: the archive had no batch limit at all; each batch now reads at most
    ``max_offsets_per_trigger`` records, and every record is archived once all the same."""
    from spark_jobs import archive

    events = produce_relay_orders(kafka_bootstrap, topic_prefix + "orders", 50)
    path, ckpt = tmp_path / "archive", tmp_path / "ckpt"
    query = archive.start(
        spark, bootstrap_servers=kafka_bootstrap, topics=re.escape(topic_prefix) + r".*",
        path=str(path), checkpoint=str(ckpt), schemas=None, value_format="json",
        available_now=True, max_offsets_per_trigger=20,
    )  # fmt: skip
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert len(sizes) >= 3 and max(sizes) <= 20 and sum(sizes) == events, sizes
    archived = spark.read.parquet(str(path))
    assert archived.count() == archived.select("message_id").distinct().count() == events
