"""Decode the relay's records: Avro (single-object encoding) or JSON values, plus headers.

The format is told per record by default (``value_format="auto"``): a value starting
with the single-object marker ``C3 01`` is Avro, anything else JSON. A relay publishes
JSON unless it has writer schemas, and one topic may carry both (a subscriber switched
formats), so a job need not be told which, and is never silently wrong about it.

The writer schema of an Avro value is found by the fingerprint in its header, among
the ``.avsc`` files (and ``*.vN.avsc`` history) of the writer's ``schemas/`` folder.
It is then resolved against the job's *reader* schema of the same full name, when the
job has one, so producers and jobs can evolve their schemas independently (Avro
resolution: added fields need defaults, and so on).

A record that cannot be decoded is never dropped: its ``error`` column says why, and
the job chooses to fail or to route it to an error sink (:func:`split_corrupt`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from relay.errors import RelayError
from relay.schemas import SchemaFolder

DECODED = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", LongType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("key", StringType()),
        StructField("message_id", StringType()),
        StructField("event_type", StringType()),
        StructField("aggregate_type", StringType()),
        StructField("transaction_id", LongType()),
        StructField("position", LongType()),
        StructField("aggregate_version", LongType()),
        StructField("payload", StringType()),  # JSON, in the reader schema's shape
        StructField("error", StringType()),  # why the record could not be decoded
    ]
)
_HEADER_COLUMNS = {
    "message_id": "id",
    "event_type": "event_type",
    "aggregate_type": "aggregate_type",
    "transaction_id": "transaction_id",
    "position": "position",
    "aggregate_version": "aggregate_version",
}
_INTEGER_HEADERS = frozenset({"transaction_id", "position", "aggregate_version"})
# With keep_value: the record's value as it came, so an undecodable one is never lost.
RAW_VALUE = StructField("value", BinaryType())
VALUE_FORMATS = ("auto", "avro", "json")
AVRO_MAGIC = b"\xc3\x01"  # Avro single-object encoding's marker


def decode_events(
    frame: DataFrame,
    *,
    writer_schemas: str | Path,
    reader_schemas: str | Path | None = None,
    value_format: str = "auto",
    keep_value: bool = False,
) -> DataFrame:
    """Kafka source rows (with ``includeHeaders``) → one row per event (``DECODED``, plus
    the raw ``value`` bytes with ``keep_value``). ``value_format``: ``auto`` (told per
    record, see the module doc), ``avro`` or ``json`` (anything else is an error row)."""
    if value_format not in VALUE_FORMATS:
        raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {value_format!r}")
    writers, readers = str(writer_schemas), None if reader_schemas is None else str(reader_schemas)
    schema = StructType([*DECODED.fields, RAW_VALUE]) if keep_value else DECODED

    def decode_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        arrow_schema = _arrow_schema(keep_value)
        for batch in batches:
            rows = [
                _decode_row(row, value_format, writers, readers, keep_value)
                for row in batch.to_pylist()
            ]
            yield pa.RecordBatch.from_pylist(rows, schema=arrow_schema)

    return frame.mapInArrow(decode_batches, schema)


def observe_decoding(
    frame: DataFrame,
    undecodable: Column | None = None,
    why: Column | None = None,
    into: Any = "decoding",
) -> DataFrame:
    """``frame``, counting its records, the undecodable ones (by default: with an
    ``error``) and the least reason (``why``, by default the ``error``) into ``into``:
    a streaming query's progress metrics of that name, which
    :class:`spark_jobs.job.DecodingAlarm` reads to say so when most are undecodable, or
    a batch job's :class:`pyspark.sql.Observation`."""
    bad = F.col("error").isNotNull() if undecodable is None else undecodable
    reason = F.col("error") if why is None else why
    return frame.observe(
        into,
        F.count(F.lit(1)).alias("records"),
        F.sum(F.when(bad, 1).otherwise(0)).alias("undecodable"),
        F.min(F.when(bad, reason)).alias("first_error"),
    )


def split_corrupt(decoded: DataFrame) -> tuple[DataFrame, DataFrame]:
    """``(events, corrupt)``: route the second to an error sink, or fail on it."""
    return decoded.where("error IS NULL"), decoded.where("error IS NOT NULL")


def _decode_row(
    row: dict[str, Any], value_format: str, writers: str, readers: str | None, keep_value: bool
) -> dict[str, Any]:
    headers = {h["key"]: h["value"] for h in row.get("headers") or []}
    decoded: dict[str, Any] = {
        "topic": row["topic"],
        "partition": row["partition"],
        "offset": row["offset"],
        "timestamp": row["timestamp"],
        "key": None if row["key"] is None else bytes(row["key"]).decode("utf-8", "replace"),
        "payload": None,
        "error": None,
    }
    for column, header in _HEADER_COLUMNS.items():
        raw = headers.get(header)
        text = None if raw is None else bytes(raw).decode("utf-8", "replace")
        decoded[column] = int(text) if text is not None and column in _INTEGER_HEADERS else text
    try:
        payload = _payload(row["value"], value_format, writers, readers)
        decoded["payload"] = json.dumps(payload, separators=(",", ":"), default=str)
    except (RelayError, ValueError, TypeError, EOFError, KeyError) as exc:
        decoded["error"] = f"{type(exc).__name__}: {exc}"
    if keep_value:
        decoded["value"] = None if row["value"] is None else bytes(row["value"])
    return decoded


def _payload(value: bytes | None, value_format: str, writers: str, readers: str | None) -> Any:
    if value is None:
        raise ValueError("the record has no value (a tombstone?)")
    data = bytes(value)
    if value_format == "json" or (value_format == "auto" and not data.startswith(AVRO_MAGIC)):
        return json.loads(data)
    registry = _registry(writers)
    writer = registry.by_fingerprint(data[2:10])  # after the 2 magic bytes
    reader = None if writer is None else _reader_for(readers, writer.full_name)
    return registry.decode(data, reader=reader)[1]  # raises on bad magic or fingerprint


@cache
def _registry(folder: str) -> SchemaFolder:
    # Once per Python worker: the folder is read on first use, then kept.
    return SchemaFolder.from_dir(folder)


def _reader_for(readers: str | None, full_name: str) -> Any:
    if readers is None:
        return None
    registry = _registry(readers)
    try:
        return registry.writer_for(full_name)
    except RelayError:
        return None  # the job has no reader schema for it: read as written


@cache
def _arrow_schema(keep_value: bool) -> Any:
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = StructType([*DECODED.fields, RAW_VALUE]) if keep_value else DECODED
    return to_arrow_schema(schema, timezone="UTC")
