from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro
from pyspark.sql.pandas.functions import arrow_udf
from pyspark.sql.types import (
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from relay.adapters.registry.confluent_wire import MAGIC as REGISTRY_MAGIC
from relay.adapters.registry.confluent_wire import unframe
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.errors import RelayError, SchemaError, SchemaRegistryUnavailable
from spark_jobs.registry_schemas import RegistryAccess, RegistrySchema

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
VALUE_FORMATS = ("auto", "avro", "json", "avro-registry")
AVRO_MAGIC = b"\xc3\x01"  # Avro single-object encoding's marker
# Which decoder takes the values whose schema is known at planning: Spark's from_avro,
# or the Python decoder for every value (bench/spark.py measures both).
AVRO_DECODERS = ("from_avro", "fastavro")
_PYTHON_RESULT = StructType(
    [StructField("payload", StringType()), StructField("error", StringType())]
)
_RESULT_NAMES = ["payload", "error"]
# from_avro: a body that does not decode is a row of nulls, not a failed query;
# to_json: a null field is written as null, as the Python decoder writes it.
_FROM_AVRO_OPTIONS = {"mode": "PERMISSIVE"}
_NATIVE = "__from_avro_payload"
_HANDLED = "__from_avro_handled"
_TO_JSON_OPTIONS = {"ignoreNullFields": "false"}


@dataclass(frozen=True)
class AvroBranch:
    """Values that start with ``header`` (single-object marker and fingerprint, or the
    wire format's zero byte and schema id): their body, after it, is Avro written with
    ``writer`` (a schema's JSON), read as ``reader`` (None: as written)."""

    header: bytes
    writer: str
    reader: str | None
    name: str
    # What from_avro (PERMISSIVE) gives for a body it cannot decode: a row of nulls.
    null_row: str


def decode_events(
    frame: DataFrame,
    *,
    writer_schemas: str | Path | None,
    reader_schemas: str | Path | None = None,
    value_format: str = "auto",
    keep_value: bool = False,
    registry: RegistryAccess | None = None,
    registry_schemas: Sequence[RegistrySchema] = (),
    avro_decoder: str = "from_avro",
) -> DataFrame:
    """Kafka source rows (with ``includeHeaders``) → one row per event (``DECODED``, plus
    the raw ``value`` bytes with ``keep_value``). ``value_format``: ``auto`` (told per
    record, see the module doc), ``avro``, ``avro-registry`` or ``json`` (anything else
    is an error row). ``registry``: where ``avro-registry`` values' schemas are looked
    up; ``registry_schemas``: those of them ``from_avro`` decodes (looked up by the
    caller: :meth:`RegistryAccess.latest_for_topics`). ``writer_schemas`` None: the job
    has no schemas folder, and a single-object Avro value is an error row saying so."""
    if value_format not in VALUE_FORMATS:
        raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {value_format!r}")
    if avro_decoder not in AVRO_DECODERS:
        raise ValueError(f"avro_decoder must be one of {AVRO_DECODERS}, got {avro_decoder!r}")
    writers = None if writer_schemas is None else str(writer_schemas)
    readers = None if reader_schemas is None else str(reader_schemas)
    branches = (
        avro_branches(value_format, writers, readers, registry_schemas)
        if avro_decoder == "from_avro"
        else []
    )
    value = F.col("value")
    # from_avro first, in a column of its own, so it runs once per record: a value it
    # did not decode (no branch, or its null row) is the Python decoder's.
    staged = frame.withColumn(_NATIVE, _from_avro_payload(value, branches))
    native = F.col(_NATIVE)
    staged = staged.withColumn(
        _HANDLED, native.isNotNull() & ~_from_avro_failed(value, branches, native)
    )
    handled = F.col(_HANDLED)
    # Spark runs a Python UDF for every row, even inside a CASE (it is pulled out into
    # its own plan node): the values from_avro decoded are sent as nulls, and the
    # vectorized decoder skips them without a Python call per row.
    python = _python_decoder(value_format, writers, readers, registry)
    fallback = python(F.when(~handled, value), handled)
    columns = [
        F.col("topic"),
        F.col("partition").cast("long").alias("partition"),
        F.col("offset").cast("long").alias("offset"),
        F.col("timestamp"),
        F.col("key").cast("string").alias("key"),
        *[_header(frame, header, column) for column, header in _HEADER_COLUMNS.items()],
        F.when(handled, native).otherwise(fallback["payload"]).alias("payload"),
        F.when(~handled, fallback["error"]).alias("error"),
    ]
    return staged.select(*columns, *([value] if keep_value else []))


def avro_branches(
    value_format: str,
    writers: str | None,
    readers: str | None,
    registry_schemas: Sequence[RegistrySchema] = (),
) -> list[AvroBranch]:
    """What ``from_avro`` decodes for ``value_format``: every writer schema of the folder
    (single-object values, by fingerprint) and the registry schemas (by id)."""
    branches: list[AvroBranch] = []
    if value_format in ("auto", "avro") and writers is not None:
        for schema in _registry(writers).schemas():
            branches.append(_branch(schema.header, schema, readers))
    if value_format in ("auto", "avro-registry"):
        for found in registry_schemas:
            schema = AvroSchema.from_json(json.loads(found.text))
            header = REGISTRY_MAGIC + found.schema_id.to_bytes(4, "big")
            branches.append(_branch(header, schema, readers))
    return branches


def _branch(header: bytes, writer: AvroSchema, readers: str | None) -> AvroBranch:
    reader = _reader_for(readers, writer.full_name)
    fields = (writer if reader is None else reader).parsed.get("fields", [])
    return AvroBranch(
        header,
        json.dumps(writer.parsed),
        None if reader is None else json.dumps(reader.parsed),
        writer.full_name,
        json.dumps(dict.fromkeys((f["name"] for f in fields), None), separators=(",", ":")),
    )


def _starts_with(value: Column, header: bytes) -> Column:
    return F.substring(value, 1, len(header)) == F.lit(bytearray(header))


def _from_avro_payload(value: Column, branches: Sequence[AvroBranch]) -> Column:
    """The JSON payload of a value a branch matches, decoded in the JVM."""
    payload: Any = F
    for branch in branches:
        options = dict(_FROM_AVRO_OPTIONS)
        if branch.reader is not None:
            options["avroSchema"] = branch.reader  # Spark's name for the reader schema
        body = F.substring(value, len(branch.header) + 1, 2**31 - 1)
        decoded = F.to_json(from_avro(body, branch.writer, options), _TO_JSON_OPTIONS)
        payload = payload.when(_starts_with(value, branch.header), decoded)
    return F.lit(None).cast("string") if payload is F else payload


def _from_avro_failed(value: Column, branches: Sequence[AvroBranch], native: Column) -> Column:
    """True where from_avro gave its row of nulls: the body did not decode (or was a
    record of nulls: the Python decoder tells which)."""
    failed: Any = F
    for branch in branches:
        failed = failed.when(_starts_with(value, branch.header), native == F.lit(branch.null_row))
    return F.lit(False) if failed is F else failed.otherwise(F.lit(False))


def _header(frame: DataFrame, header: str, column: str) -> Column:
    """A relay header's value (the last of that name), as text or a number."""
    if "headers" not in frame.columns:
        text = F.lit(None).cast("string")
    else:
        # The last of that name is the first of the reversed keys. No lambda (a filter per
        # header): array functions compile to code, and the reversed keys are shared.
        found = F.array_position(F.reverse(F.col("headers.key")), header).cast("int")
        text = F.when(found > 0, F.element_at(F.col("headers.value"), -found)).cast("string")
    if column in _INTEGER_HEADERS:
        # Not a number: a null, not a failed query (Spark's ANSI casts raise).
        text = F.when(text.rlike(r"^-?[0-9]{1,18}$"), text.cast("long"))
    return text.alias(column)


def _python_decoder(
    value_format: str, writers: str | None, readers: str | None, registry: RegistryAccess | None
) -> Any:
    """The vectorized UDF ``(value, skip) -> (payload, error)`` for the values from_avro
    does not take (``skip`` those it does: no Python work for them)."""

    def decode(values: pa.Array, skip: pa.Array) -> pa.Array:
        size = len(values)
        todo = pc.indices_nonzero(pc.invert(skip))
        if len(todo) == 0:
            return pa.StructArray.from_arrays([pa.nulls(size, pa.string())] * 2, _RESULT_NAMES)
        payloads: list[str | None] = [None] * size
        errors: list[str | None] = [None] * size
        for row, value in zip(todo.to_pylist(), values.take(todo).to_pylist(), strict=True):
            payloads[row], errors[row] = _decode_one(
                value, value_format, writers, readers, registry
            )
        return pa.StructArray.from_arrays(
            [pa.array(payloads, pa.string()), pa.array(errors, pa.string())], _RESULT_NAMES
        )

    # Typed arguments tell Spark the UDF's kind (arrays in, array out); the stubs lack that form.
    return arrow_udf(decode, _PYTHON_RESULT)  # type: ignore[call-overload]


def _decode_one(
    value: bytes | None,
    value_format: str,
    writers: str | None,
    readers: str | None,
    registry: RegistryAccess | None,
) -> tuple[str | None, str | None]:
    """``(payload, error)`` of one value, by the Python decoder."""
    try:
        payload = _payload(value, value_format, writers, readers, registry)
        return json.dumps(payload, separators=(",", ":"), default=str), None
    except SchemaRegistryUnavailable:
        raise  # the records are fine: fail the batch, a restart reads them again
    except Exception as exc:  # fastavro raises many types: any is this record's error
        return None, f"{type(exc).__name__}: {exc}"


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


def _payload(
    value: bytes | None,
    value_format: str,
    writers: str | None,
    readers: str | None,
    registry: RegistryAccess | None,
) -> Any:
    if value is None:
        raise ValueError("the record has no value (a tombstone?)")
    data = bytes(value)
    if value_format == "avro-registry" or (
        value_format == "auto" and data.startswith(REGISTRY_MAGIC)
    ):
        return _registry_payload(data, readers, registry)
    if value_format == "json" or (value_format == "auto" and not data.startswith(AVRO_MAGIC)):
        return json.loads(data)
    if writers is None:
        raise SchemaError(
            "an Avro single-object value, but the job has no writer schemas: pass --schemas "
            "(or set RELAY_SCHEMAS_DIR), the folder the relay encodes with"
        )
    folder = _registry(writers)
    writer = folder.by_fingerprint(data[2:10])  # after the 2 magic bytes
    reader = None if writer is None else _reader_for(readers, writer.full_name)
    return folder.decode(data, reader=reader)[1]  # raises on bad magic or fingerprint


def _registry_payload(data: bytes, readers: str | None, registry: RegistryAccess | None) -> Any:
    import fastavro

    schema_id, body = unframe(data)
    if registry is None:
        raise SchemaError(
            f"a schema-registry value (schema id {schema_id}), but the job knows no registry: "
            "set schema_registry_url (RELAY_SCHEMA_REGISTRY_URL), as for the relay"
        )
    writer = _registry_writer(registry, schema_id)
    reader = _reader_for(readers, writer.full_name)
    reader_schema = None if reader is None else reader.parsed
    return fastavro.schemaless_reader(io.BytesIO(body), writer.parsed, reader_schema)


@cache
def _registry_writer(registry: RegistryAccess, schema_id: int) -> AvroSchema:
    # Ids never change meaning in a registry: once per id and Python worker.
    return AvroSchema.from_json(json.loads(registry.schema_by_id(schema_id)))


@cache
def _registry(folder: str) -> SchemaFolder:
    # Once per Python worker: the folder is read on first use, then kept.
    return SchemaFolder.from_dir(folder)


def _reader_for(readers: str | None, full_name: str) -> AvroSchema | None:
    if readers is None:
        return None
    registry = _registry(readers)
    try:
        return registry.writer_for(full_name)
    except RelayError:
        return None  # the job has no reader schema for it: read as written
