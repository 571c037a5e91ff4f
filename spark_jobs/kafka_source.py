"""A Kafka streaming source for Spark, on PySpark's Python Data Source API.

It mirrors Spark's built-in ``format("kafka")`` source, whose connector jar cannot be
fetched everywhere: the same columns (``key``, ``value``, ``topic``, ``partition``,
``offset``, ``timestamp``, ``timestampType``, and ``headers`` with
``includeHeaders``), the same option names, the same offset JSON in the checkpoint.
Records are read with confluent-kafka, ``read_committed``, and yielded as Arrow batches.

Options: ``subscribe`` | ``subscribePattern`` | ``assign``; ``startingOffsets``
(earliest, latest, JSON); ``maxOffsetsPerTrigger``; ``failOnDataLoss`` (default true);
``includeHeaders`` (default false); ``kafka.*`` passed to the client.

Replays are deterministic: every batch's end offsets are in Spark's offset log before
the batch runs, and a batch starts where the previous one ended. One exception: the
Python API gives a source nowhere to persist its *initial* offsets, so with
``startingOffsets=latest`` a crash before the very first batch commits re-resolves
"latest" on restart. Jobs that need exactly-once from the first record use
``earliest`` or explicit JSON offsets (the jobs here use ``earliest``).

Which process runs what: the offset methods run in one long-lived driver-side Python
process; ``read`` runs in executor workers, on a pickled copy of the reader. So no
Kafka client is created in ``__init__`` or survives pickling.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark_jobs import kafka_offsets
from spark_jobs.kafka_offsets import Offsets, Watermarks

logger = logging.getLogger(__name__)

FORMAT = "outbox_kafka"  # "kafka" is reserved by Spark even without the connector jar
_COLUMNS = [
    StructField("key", BinaryType()),
    StructField("value", BinaryType()),
    StructField("topic", StringType()),
    StructField("partition", IntegerType()),
    StructField("offset", LongType()),
    StructField("timestamp", TimestampType()),
    StructField("timestampType", IntegerType()),
]
HEADERS = StructField(
    "headers",
    ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())])),
)
_READ_BATCH = 10_000  # records per Arrow batch
_METADATA_TIMEOUT_S = 30.0
_POSITION_SETTLE_S = 1.0


class KafkaSourceError(ValueError):
    """Bad options, or a condition the options say to fail on (data loss)."""


def kafka_schema(include_headers: bool = False) -> StructType:
    return StructType(_COLUMNS + ([HEADERS] if include_headers else []))


class KafkaRange(InputPartition):
    """One topic-partition's offsets ``[start, end)`` for one micro-batch."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        self.topic, self.partition, self.start, self.end = topic, partition, start, end

    def __repr__(self) -> str:
        return f"KafkaRange({self.topic}-{self.partition} [{self.start}, {self.end}))"


class SourceOptions:
    """The options, validated once, with errors that name the option."""

    def __init__(self, options: Mapping[str, str]) -> None:
        get = options.get
        chosen = [k for k in ("subscribe", "subscribePattern", "assign") if get(k)]
        if len(chosen) != 1:
            raise KafkaSourceError(
                "exactly one of the options subscribe, subscribePattern, assign is required"
            )
        self.subscribe = [t.strip() for t in (get("subscribe") or "").split(",") if t.strip()]
        pattern = get("subscribePattern")
        try:
            self.pattern = re.compile(pattern) if pattern else None
        except re.error as exc:
            raise KafkaSourceError(f"subscribePattern {pattern!r}: {exc}") from exc
        self.assign = _parse_assign(get("assign"))
        self.starting = get("startingOffsets") or "latest"
        self.max_offsets = _positive_int(get("maxOffsetsPerTrigger"), "maxOffsetsPerTrigger")
        self.fail_on_data_loss = _flag(get("failOnDataLoss"), "failOnDataLoss", default=True)
        self.include_headers = _flag(get("includeHeaders"), "includeHeaders", default=False)
        self.kafka = {k[6:]: v for k, v in options.items() if k.lower().startswith("kafka.")}
        if "bootstrap.servers" not in self.kafka:
            raise KafkaSourceError("option kafka.bootstrap.servers is required")


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, schema: StructType, options: Mapping[str, str]) -> None:
        self.schema = schema
        self.options = SourceOptions(options)
        self._metadata: Consumer | None = None
        self._initial: Offsets | None = None
        self._available_now: Offsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_metadata"] = None  # never ship a live client to the executors
        return state

    # -- driver: offsets -----------------------------------------------------------------

    def initialOffset(self) -> Offsets:
        # Spark asks twice before the first batch: "latest" must not move in between.
        if self._initial is None:
            try:
                self._initial = kafka_offsets.starting_offsets(
                    self.options.starting, self._watermarks()
                )
            except kafka_offsets.OffsetSpecError as exc:
                raise KafkaSourceError(str(exc)) from exc
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        max_offsets = self.options.max_offsets
        return ReadMaxRows(max_offsets) if max_offsets else ReadAllAvailable()

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        latest = self._available_now or self._latest()
        end = kafka_offsets.advance(start, latest)
        if isinstance(limit, ReadMaxRows):
            end = kafka_offsets.rate_limit(start, end, limit.max_rows)
        return end

    def reportLatestOffset(self) -> Offsets:
        return self._latest()

    def prepareForTriggerAvailableNow(self) -> None:
        # Trigger.AvailableNow: everything up to now, and then stop.
        self._available_now = self._latest()

    def partitions(self, start: Offsets, end: Offsets) -> list[InputPartition]:
        start = self._check_data_loss(start, end)
        return [KafkaRange(*r) for r in kafka_offsets.ranges(start, end)]

    def commit(self, end: Offsets) -> None:
        """Nothing to do: as with Spark's source, the checkpoint is the only truth."""

    def stop(self) -> None:
        if self._metadata is not None:
            self._metadata.close()
            self._metadata = None

    # -- executors: records ----------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        assert isinstance(partition, KafkaRange)
        # Must equal what the worker expects exactly (timestamp[us, tz=UTC] and all).
        arrow_schema = to_arrow_schema(self.schema, timezone="UTC")
        for messages in _read_range(self.options.kafka, partition):
            stamps = [m.timestamp() for m in messages]  # (type, ms since the epoch)
            columns = [
                pa.array([m.key() for m in messages], pa.binary()),
                pa.array([m.value() for m in messages], pa.binary()),
                pa.array([partition.topic] * len(messages), pa.string()),
                pa.array([partition.partition] * len(messages), pa.int32()),
                pa.array([m.offset() for m in messages], pa.int64()),
                pa.array([ms * 1000 for _, ms in stamps], pa.int64()).cast(
                    pa.timestamp("us", tz="UTC")
                ),
                # librdkafka: 1 create time, 2 log append time; Kafka/Spark: 0 and 1.
                pa.array([max(kind - 1, -1) for kind, _ in stamps], pa.int32()),
            ]
            if self.options.include_headers:
                columns.append(
                    pa.array(
                        [_headers(m) for m in messages],
                        arrow_schema.field("headers").type,
                    )
                )
            yield pa.RecordBatch.from_arrays(columns, schema=arrow_schema)

    # -- driver: metadata ------------------------------------------------------------------

    def _consumer(self) -> Consumer:
        if self._metadata is None:
            self._metadata = Consumer(
                {
                    "group.id": "outbox-kafka-source-metadata",
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    **self.options.kafka,
                }
            )
        return self._metadata

    def _topic_partitions(self) -> dict[str, list[int]]:
        if self.options.assign:
            return self.options.assign
        topics = self._consumer().list_topics(timeout=_METADATA_TIMEOUT_S).topics
        if self.options.pattern is not None:
            names = [t for t in topics if self.options.pattern.fullmatch(t)]
        else:
            names = [t for t in self.options.subscribe if t in topics]
        return {t: sorted(topics[t].partitions) for t in names if topics[t].error is None}

    def _watermarks(self) -> Watermarks:
        consumer = self._consumer()
        return {
            topic: {
                str(p): consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=_METADATA_TIMEOUT_S
                )
                for p in partitions
            }
            for topic, partitions in self._topic_partitions().items()
        }

    def _latest(self) -> Offsets:
        return {t: {p: hi for p, (_, hi) in ps.items()} for t, ps in self._watermarks().items()}

    def _check_data_loss(self, start: Offsets, end: Offsets) -> Offsets:
        """Offsets below the log start were deleted (retention) before we read them.
        A partition new since the last batch starts at its log start (earliest)."""
        watermarks = self._watermarks()
        checked: Offsets = {}
        for topic, parts in end.items():
            checked[topic] = {}
            for partition in parts:
                low = watermarks.get(topic, {}).get(partition, (0, 0))[0]
                offset = start.get(topic, {}).get(partition)
                if offset is None:
                    checked[topic][partition] = low
                    continue
                if offset < low:
                    message = (
                        f"{topic}-{partition}: offsets {offset}..{low - 1} were deleted from "
                        f"Kafka before this query read them (retention?)"
                    )
                    if self.options.fail_on_data_loss:
                        raise KafkaSourceError(
                            message + "; set failOnDataLoss=false to skip them and go on"
                        )
                    logger.warning("%s; skipping them (failOnDataLoss=false)", message)
                checked[topic][partition] = max(offset, low)
        return checked


class KafkaSource(DataSource):
    """``spark.dataSource.register(KafkaSource)``, then ``readStream.format(FORMAT)``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return kafka_schema(_flag(self.options.get("includeHeaders"), "includeHeaders", False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(schema, self.options)


def _read_range(config: Mapping[str, str], part: KafkaRange) -> Iterator[list[Message]]:
    """Lists of records with ``start <= offset < end``, read_committed.

    Transaction markers occupy offsets, so the last record may sit below ``end - 1``:
    the read ends when the consumer's position reaches ``end``.
    """
    consumer = Consumer(
        {
            "group.id": "outbox-kafka-source",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 50,
            "auto.offset.reset": "error",
            **config,
        }
    )
    where = TopicPartition(part.topic, part.partition)
    consumer.assign([TopicPartition(part.topic, part.partition, part.start)])
    started = last_progress = time.monotonic()
    received = False
    try:
        while True:
            # consume() waits for as many records as asked: never ask beyond the range.
            messages = consumer.consume(max(1, min(_READ_BATCH, part.end - part.start)), 0.1)
            batch = []
            for message in messages:
                error = message.error()
                if error is not None and error.code() != KafkaError._PARTITION_EOF:
                    raise KafkaSourceError(f"reading {part}: {error.str()}")
                if error is None and (offset := message.offset() or 0) < part.end:
                    batch.append(message)
                    if offset + 1 >= part.end:
                        break
            if batch:
                last_progress, received = time.monotonic(), True
                yield batch
                if (batch[-1].offset() or 0) + 1 >= part.end:
                    return
            # A range can end in (or hold only) transaction markers: then the position
            # says when we are done. Before any record arrived, trust it only after a
            # moment: some brokers report the end of the partition before its data.
            settled = received or time.monotonic() - started > _POSITION_SETTLE_S
            if settled and consumer.position([where])[0].offset >= part.end:
                return
            if time.monotonic() - last_progress > _METADATA_TIMEOUT_S * 2:
                raise KafkaSourceError(f"no progress reading {part} for a minute")
    finally:
        consumer.close()


def _headers(message: Message) -> list[dict[str, Any]]:
    return [{"key": h[0], "value": h[1]} for h in message.headers() or []]


def _parse_assign(text: str | None) -> dict[str, list[int]]:
    if not text:
        return {}
    try:
        value = json.loads(text)
        return {str(t): [int(p) for p in parts] for t, parts in value.items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise KafkaSourceError(
            f'assign must be JSON such as {{"topic": [0, 1]}}; got {text!r}'
        ) from exc


def _positive_int(text: str | None, name: str) -> int | None:
    if text is None or text == "":
        return None
    if not text.isdigit() or int(text) <= 0:
        raise KafkaSourceError(f"{name} must be a positive integer; got {text!r}")
    return int(text)


def _flag(text: str | None, name: str, default: bool) -> bool:
    if text is None:
        return default
    if text.lower() not in ("true", "false"):
        raise KafkaSourceError(f"{name} must be true or false; got {text!r}")
    return text.lower() == "true"
