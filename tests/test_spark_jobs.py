"""Spark jobs end to end: outbox → relay → Kafka → Spark → Postgres, exactly once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from relay import Outbox
from relay.daemon import Relay
from relay.store import OutboxStore
from spark_jobs import order_projection
from spark_jobs.session import local_session
from tests.support import sub

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = local_session("outbox-relay-job-tests")
    yield session
    session.stop()


def write_order_story(db: psycopg.Connection[Any], outbox: Outbox) -> None:
    for i in range(10):
        with db.transaction():
            payload = {"order_id": f"o-{i}", "customer_id": f"c-{i % 3}", "amount_cents": 100 * i}
            outbox.append(db, aggregate_type="order", aggregate_id=f"o-{i}",
                          event_type="OrderPlaced", payload=payload)  # fmt: skip
    for i in range(0, 10, 2):
        outbox.append(db, aggregate_type="order", aggregate_id=f"o-{i}",
                      event_type="OrderShipped", payload={"order_id": f"o-{i}", "carrier": "dhl"})  # fmt: skip


def run_projection(spark: SparkSession, url: str, bootstrap: str, topic: str, ckpt: Path) -> int:
    query = order_projection.start(
        spark,
        bootstrap_servers=bootstrap,
        topic=topic,
        database_url=url,
        checkpoint=str(ckpt),
        schemas=str(REPO / "schemas"),
        available_now=True,
    )
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return sum(p["numInputRows"] for p in query.recentProgress)


def test_projection_is_exact_and_a_replayed_batch_changes_nothing(
    spark: SparkSession,
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    tmp_path: Path,
) -> None:
    start_relay(subscribers=[sub("s", topic_prefix)])
    write_order_story(db, outbox)
    store = OutboxStore(db)
    deadline = time.monotonic() + 30
    while store.get("s").lag(store) and time.monotonic() < deadline:
        time.sleep(0.1)
    topic, ckpt = topic_prefix + "outbox.event.order", tmp_path / "ckpt"

    assert run_projection(spark, database_url, kafka_bootstrap, topic, ckpt) == 15
    expected = [
        (f"o-{i}", f"c-{i % 3}", 100 * i, "shipped" if i % 2 == 0 else "placed",
         "dhl" if i % 2 == 0 else None)
        for i in range(10)
    ]  # fmt: skip
    query = (
        "SELECT order_id, customer_id, amount_cents, status, carrier FROM orders ORDER BY position"
    )
    rows = db.execute(query).fetchall()
    assert sorted(rows) == sorted(expected)

    # A driver crash after the sink committed but before Spark logged the batch: Spark
    # runs the batch again on restart. The marker makes the sink skip it.
    commits = sorted((ckpt / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    commits[-1].unlink()
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    assert run_projection(spark, database_url, kafka_bootstrap, topic, ckpt) == 15
    assert sorted(db.execute(query).fetchall()) == sorted(expected)
    markers = db.execute("SELECT count(*), sum(rows) FROM spark_sink_batches").fetchone()
    assert markers == (1, 15)
