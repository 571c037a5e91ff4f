"""The contract every Kafka source the project offers must meet, on a real local Spark
session and the real local Apache Kafka.

The suite is parametrized by the source's format name. Spark's built-in connector
(``kafka``) is the only source the project keeps; it passing shows the tests are right,
and a source added later must pass the same tests.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewPartitions,
    NewTopic,
)

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession

from spark_jobs.spark_session import kafka_options

pytestmark = pytest.mark.spark

SOURCES = ["kafka"]  # Spark's own connector; any other source the project offers joins here

Rows = list[tuple[Any, ...]]


@pytest.fixture(params=SOURCES)
def source(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture
def new_topic(admin: AdminClient) -> Callable[..., str]:
    def create(partitions: int = 1, name: str | None = None) -> str:
        name = name or f"contract-{uuid.uuid4().hex[:10]}"
        # Some records are stamped in the past: time-based retention must not take them.
        topic = NewTopic(name, partitions, -1, config={"retention.ms": "-1"})
        for future in admin.create_topics([topic]).values():
            future.result()
        return name

    return create


def producer(bootstrap: str, *, transactional: bool = True) -> Producer:
    config = {"bootstrap.servers": bootstrap, "linger.ms": 5}
    if transactional:
        config["transactional.id"] = f"contract-{uuid.uuid4()}"
    made = Producer(config)
    if transactional:
        made.init_transactions(30)
    return made


def send(
    bootstrap: str,
    topic: str,
    values: list[str | None],
    *,
    partition: int = 0,
    abort: bool = False,
    key: bytes | None = b"k",
    timestamps: list[int] | None = None,
) -> None:
    """One transaction (committed, or aborted) of ``values`` to one partition."""
    made = producer(bootstrap)
    made.begin_transaction()
    for i, value in enumerate(values):
        encoded = None if value is None else value.encode()
        stamp = {"timestamp": timestamps[i]} if timestamps else {}
        made.produce(topic, encoded, key, partition=partition, **stamp)
    made.flush(30)
    if abort:
        made.abort_transaction(30)
    else:
        made.commit_transaction(30)


def send_plain(bootstrap: str, topic: str, counts: dict[int, int], tag: str = "") -> None:
    """Non-transactional records (one offset each): ``counts`` per partition."""
    made = producer(bootstrap, transactional=False)
    for partition, count in counts.items():
        for i in range(count):
            made.produce(topic, f"{tag}p{partition}-{i}".encode(), None, partition=partition)
    assert made.flush(30) == 0


class Run:
    """A streaming query whose micro-batches land in a Python list on the driver."""

    def __init__(self) -> None:
        self.batches: list[Rows] = []

    def sink(self, frame: DataFrame, batch_id: int) -> None:
        rows = frame.selectExpr("CAST(value AS STRING)", "partition", "offset").collect()
        if rows:
            self.batches.append([tuple(r) for r in rows])

    @property
    def values(self) -> list[str]:
        return sorted(str(r[0]) for batch in self.batches for r in batch)


def stream(spark: SparkSession, source: str, bootstrap: str, **options: str) -> DataFrame:
    return (
        spark.readStream.format(source).options(**kafka_options(bootstrap)).options(**options)
    ).load()


def available_now(
    spark: SparkSession, source: str, bootstrap: str, checkpoint: Path, **options: str
) -> Run:
    """One ``Trigger.AvailableNow`` run to its end; raises what the query raised."""
    run = Run()
    query = (
        stream(spark, source, bootstrap, **options)
        .writeStream.foreachBatch(run.sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(240)
    error = query.exception()
    if error is not None:
        raise AssertionError(f"query failed: {error}")
    return run


def failure_of(
    spark: SparkSession, source: str, bootstrap: str, checkpoint: Path, **options: str
) -> str:
    """The error an AvailableNow run ends with (it must end with one)."""
    with pytest.raises(Exception) as caught:
        available_now(spark, source, bootstrap, checkpoint, **options)
    return str(caught.value)


@contextlib.contextmanager
def continuous(
    spark: SparkSession, source: str, bootstrap: str, checkpoint: Path, **options: str
) -> Iterator[tuple[Run, Any]]:
    """A query on a 200 ms processing-time trigger, stopped on exit."""
    run = Run()
    query = (
        stream(spark, source, bootstrap, **options)
        .writeStream.foreachBatch(run.sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        yield run, query
    finally:
        query.stop()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- the contract


def test_read_committed_hides_aborted_records_even_in_ranges_of_markers_only(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic()
    send(kafka_bootstrap, topic, ["a1", "a2", "a3"])
    send(kafka_bootstrap, topic, ["x1", "x2", "x3"], abort=True)
    send(kafka_bootstrap, topic, ["b1"])
    # Batches of 2 offsets: some ranges hold only aborted records and markers.
    options = {"subscribe": topic, "startingOffsets": "earliest", "maxOffsetsPerTrigger": "2"}
    first = available_now(spark, source, kafka_bootstrap, tmp_path / "ckpt", **options)
    assert first.values == ["a1", "a2", "a3", "b1"]

    send(kafka_bootstrap, topic, ["y1", "y2"], abort=True)  # all that is new: aborted
    nothing = available_now(spark, source, kafka_bootstrap, tmp_path / "ckpt", **options)
    assert nothing.values == []

    send(kafka_bootstrap, topic, ["c1"])
    last = available_now(spark, source, kafka_bootstrap, tmp_path / "ckpt", **options)
    assert last.values == ["c1"]


def test_null_keys_and_null_values_come_through_as_nulls(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic()
    send(kafka_bootstrap, topic, [None, "v"], key=None)
    frame = stream(spark, source, kafka_bootstrap, subscribe=topic, startingOffsets="earliest")
    seen: list[tuple[Any, ...]] = []

    def keep(batch: DataFrame, batch_id: int) -> None:
        seen.extend(tuple(r) for r in batch.select("key", "value").collect())

    query = (
        frame.writeStream.foreachBatch(keep)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(240)
    assert query.exception() is None
    assert sorted(seen, key=repr) == sorted([(None, None), (None, bytearray(b"v"))], key=repr)


def test_subscribe_pattern_picks_up_a_topic_created_later_from_its_start(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    prefix = f"pattern-{uuid.uuid4().hex[:8]}"
    first = new_topic(name=f"{prefix}-a")
    send(kafka_bootstrap, first, ["a1"])
    options = {"subscribePattern": f"{prefix}-.*", "startingOffsets": "earliest"}
    assert available_now(spark, source, kafka_bootstrap, tmp_path / "c", **options).values == ["a1"]

    second = new_topic(name=f"{prefix}-b")
    send(kafka_bootstrap, second, ["b1", "b2"])
    send(kafka_bootstrap, first, ["a2"])
    later = available_now(spark, source, kafka_bootstrap, tmp_path / "c", **options)
    assert later.values == ["a2", "b1", "b2"]


def test_partitions_added_while_a_query_runs_are_read_from_their_start(
    spark: SparkSession,
    source: str,
    kafka_bootstrap: str,
    new_topic: Any,
    admin: AdminClient,
    tmp_path: Path,
) -> None:
    topic = new_topic(1)
    send(kafka_bootstrap, topic, ["p0-a"])
    options = {"subscribe": topic, "startingOffsets": "earliest"}
    with continuous(spark, source, kafka_bootstrap, tmp_path / "c", **options) as (run, _):
        wait_for(lambda: run.values == ["p0-a"], "the first record")
        for future in admin.create_partitions([NewPartitions(topic, 3)]).values():
            future.result()
        send(kafka_bootstrap, topic, ["p1-a", "p1-b"], partition=1)
        send(kafka_bootstrap, topic, ["p2-a"], partition=2)
        wait_for(lambda: len(run.values) >= 4, "the records of the new partitions")
    assert run.values == ["p0-a", "p1-a", "p1-b", "p2-a"]


def test_available_now_with_max_offsets_splits_by_partition_size_across_a_restart(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic(3)
    send_plain(kafka_bootstrap, topic, {0: 101, 1: 11, 2: 1})
    options = {"subscribe": topic, "startingOffsets": "earliest", "maxOffsetsPerTrigger": "10"}
    first = available_now(spark, source, kafka_bootstrap, tmp_path / "c", **options)

    per_partition = [sorted({p: sum(1 for r in b if r[1] == p) for p in range(3)}.items())
                     for b in first.batches]  # fmt: skip
    assert per_partition[0] == [(0, 8), (1, 1), (2, 1)]  # proportional, every partition moves
    assert all(len(b) <= 10 for b in first.batches)
    assert len(first.values) == 113 == len(set(first.values))

    send_plain(kafka_bootstrap, topic, {0: 5, 2: 5}, tag="new-")  # after a stop: no repeats
    second = available_now(spark, source, kafka_bootstrap, tmp_path / "c", **options)
    assert all(len(b) <= 10 for b in second.batches)
    assert second.values == sorted(f"new-p{p}-{i}" for p in (0, 2) for i in range(5))


def test_min_offsets_per_trigger_waits_for_enough_records_or_max_trigger_delay(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic()
    send(kafka_bootstrap, topic, [f"a{i}" for i in range(20)])
    options = {"subscribe": topic, "startingOffsets": "earliest", "minOffsetsPerTrigger": "30"}
    # A query's first trigger is never delayed; the ones after it wait for 30 offsets.
    waiting = {**options, "maxTriggerDelay": "1h"}
    with continuous(spark, source, kafka_bootstrap, tmp_path / "min", **waiting) as (run, _):
        wait_for(lambda: len(run.batches) == 1, "the first batch")
        send(kafka_bootstrap, topic, [f"b{i}" for i in range(10)])  # 11 offsets: too few
        send(kafka_bootstrap, topic, [f"c{i}" for i in range(20)])  # 32 offsets: enough
        wait_for(lambda: len(run.batches) == 2, "a batch once enough offsets are there")
    assert [len(b) for b in run.batches] == [20, 30]  # not 20, 10, 20

    delayed = {**options, "maxTriggerDelay": "1s"}
    with continuous(spark, source, kafka_bootstrap, tmp_path / "dly", **delayed) as (run, _):
        wait_for(lambda: len(run.batches) == 1, "the first batch")
        send(kafka_bootstrap, topic, ["d0"])
        wait_for(lambda: len(run.batches) == 2, "a batch after maxTriggerDelay")
    assert run.batches[1] and [r[0] for r in run.batches[1]] == ["d0"]


def test_starting_offsets_json_without_every_partition_is_an_error(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic(2)
    send(kafka_bootstrap, topic, ["a"])
    partial = json.dumps({topic: {"0": -2}})
    message = failure_of(
        spark, source, kafka_bootstrap, tmp_path / "c", subscribe=topic, startingOffsets=partial
    )
    assert f"{topic}-1" in message


def test_starting_offsets_by_timestamp_starts_at_the_first_record_at_or_after_it(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic(2)
    t0 = 1_700_000_000_000
    for partition in (0, 1):
        stamps = [t0 + 1000 * i for i in range(6)]
        values = [f"p{partition}-t{i}" for i in range(6)]
        send(kafka_bootstrap, topic, values, partition=partition, timestamps=stamps)  # type: ignore[arg-type]
    by_timestamp = json.dumps({topic: {"0": t0 + 4000, "1": t0 + 2500}})
    run = available_now(
        spark, source, kafka_bootstrap, tmp_path / "c",
        subscribe=topic, startingOffsetsByTimestamp=by_timestamp,
    )  # fmt: skip
    assert run.values == ["p0-t4", "p0-t5", "p1-t3", "p1-t4", "p1-t5"]


def test_fail_on_data_loss_against_records_deleted_by_retention(
    spark: SparkSession,
    source: str,
    kafka_bootstrap: str,
    new_topic: Any,
    admin: AdminClient,
    tmp_path: Path,
) -> None:
    topic = new_topic()
    send_plain(kafka_bootstrap, topic, {0: 10})
    options = {"subscribe": topic, "startingOffsets": "earliest"}
    for checkpoint in ("strict", "lenient"):
        assert len(available_now(spark, source, kafka_bootstrap, tmp_path / checkpoint,
                                 **options).values) == 10  # fmt: skip
    send_plain(kafka_bootstrap, topic, {0: 10})  # offsets 10..19, named p0-0..p0-9 again
    # Retention takes offsets below 15 before the queries read 10..14.
    for future in admin.delete_records([TopicPartition(topic, 0, 15)]).values():
        future.result()

    message = failure_of(spark, source, kafka_bootstrap, tmp_path / "strict", **options)
    assert f"{topic}-0" in message and "failOnDataLoss" in message

    lenient = available_now(
        spark, source, kafka_bootstrap, tmp_path / "lenient", failOnDataLoss="false", **options
    )
    assert [r[2] for b in lenient.batches for r in b] == [15, 16, 17, 18, 19]


def test_a_deleted_topic_is_not_read_again_and_a_recreated_one_is_not_masked(
    spark: SparkSession,
    source: str,
    kafka_bootstrap: str,
    new_topic: Any,
    admin: AdminClient,
    tmp_path: Path,
) -> None:
    prefix = f"gone-{uuid.uuid4().hex[:8]}"
    kept, doomed = new_topic(name=f"{prefix}-kept"), new_topic(name=f"{prefix}-doomed")
    send(kafka_bootstrap, doomed, ["d1", "d2", "d3", "d4"])
    send(kafka_bootstrap, kept, ["k1"])
    options = {"subscribePattern": f"{prefix}-.*", "startingOffsets": "earliest"}
    lenient = {**options, "failOnDataLoss": "false"}
    for checkpoint in ("strict", "lenient"):
        first = available_now(spark, source, kafka_bootstrap, tmp_path / checkpoint, **options)
        assert first.values == ["d1", "d2", "d3", "d4", "k1"]

    for future in admin.delete_topics([doomed]).values():
        future.result()
    wait_for(lambda: doomed not in admin.list_topics(timeout=10).topics, "the deletion")
    send(kafka_bootstrap, kept, ["k2"])
    after = available_now(spark, source, kafka_bootstrap, tmp_path / "lenient", **lenient)
    assert after.values == ["k2"]  # nothing of the deleted topic again

    # Recreated with fewer records than were read: its offsets went backwards.
    new_topic(name=doomed)
    send(kafka_bootstrap, doomed, ["n1"])
    message = failure_of(spark, source, kafka_bootstrap, tmp_path / "strict", **options)
    assert doomed in message and "failOnDataLoss" in message


def test_initial_offsets_survive_a_crash_before_the_first_batch_commits(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    topic = new_topic()
    send(kafka_bootstrap, topic, ["before-1", "before-2"])
    checkpoint = tmp_path / "c"
    options = {"subscribe": topic, "startingOffsets": "latest"}

    def crash(frame: DataFrame, batch_id: int) -> None:
        raise RuntimeError("sink down")

    query = (
        stream(spark, source, kafka_bootstrap, **options)
        .writeStream.foreachBatch(crash)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    with contextlib.suppress(Exception):
        query.awaitTermination(240)
    assert query.exception() is not None
    assert not list((checkpoint / "commits").glob("[0-9]*"))  # no batch committed

    send(kafka_bootstrap, topic, ["after-1", "after-2"])  # while the query is down
    # "latest" is not resolved again on restart: what arrived meanwhile is read.
    again = available_now(spark, source, kafka_bootstrap, checkpoint, **options)
    assert again.values == ["after-1", "after-2"]


@pytest.mark.parametrize(
    "option", ["kafka.auto.offset.reset", "kafka.enable.auto.commit", "kafka.key.deserializer"]
)
def test_kafka_options_the_source_owns_are_refused(
    spark: SparkSession, source: str, kafka_bootstrap: str, new_topic: Any, option: str
) -> None:
    """They would override how the source tracks offsets: refused, never applied."""
    topic = new_topic()
    with pytest.raises(Exception) as caught:
        stream(spark, source, kafka_bootstrap, subscribe=topic, **{option: "x"})
    assert option.removeprefix("kafka.") in str(caught.value)
