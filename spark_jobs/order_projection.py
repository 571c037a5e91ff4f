"""Job (a): keep an ``orders`` read model in Postgres up to date from the order events.

Exactly once end to end: the Kafka source's offsets live in the Spark checkpoint, and
each micro-batch commits in one Postgres transaction with its batch marker
(:class:`PostgresBatchSink`). On top of that, every upsert is guarded by the event's
``(transaction_id, position)``, the relay's publication order, so even a replay from an
older checkpoint can never move an order's state backwards.

An order event the table cannot take (no ``order_id``, an ``amount_cents`` that is not
a whole number within bigint, no relay headers; or a row Postgres refuses, such as a
constraint added to the table) is quarantined, not retried forever: it goes, with its
reason, to the sink's error table (``spark_corrupt_records``, where ``--on-corrupt
route`` sends undecodable records), in the batch's transaction, and the job goes on.

Run locally (embedded default) or with ``spark-submit``::

    RELAY_DATABASE_URL_FILE=/run/secrets/db-url \\
    python -m spark_jobs.order_projection --bootstrap-servers 127.0.0.1:9092 \\
        --checkpoint /tmp/orders-ckpt

(``--database-url`` works too, but shows the password in ``ps``.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psycopg
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F

from relay.core.log_fields import log_extra
from relay.core.settings import KafkaValue
from relay.errors import RelayError
from spark_jobs.decoding import VALUE_FORMATS, decode_events, split_corrupt
from spark_jobs.driver_rows import chunks, local_rows
from spark_jobs.job import await_query, job_session, registry_access, report_decoding, run
from spark_jobs.postgres_sink import PostgresBatchSink, connect, create_table
from spark_jobs.preflight import SCHEMAS_HELP, schemas_folder
from spark_jobs.registry_schemas import RegistryAccess, planned_schemas
from spark_jobs.run_summary import RunSummary
from spark_jobs.sink_job_args import sink_job_options, sink_job_parser
from spark_jobs.spark_session import (
    MAX_OFFSETS_PER_TRIGGER,
    kafka_options,
    kafka_stream,
    streaming_query_id,
)

logger = logging.getLogger(__name__)

ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    order_id       text PRIMARY KEY,
    customer_id    text,
    amount_cents   bigint,
    status         text NOT NULL,
    carrier        text,
    transaction_id bigint NOT NULL,
    position       bigint NOT NULL
)
"""
# Fields an event does not carry keep their value; older events never win.
UPSERT = """
INSERT INTO orders AS o
    (order_id, customer_id, amount_cents, status, carrier, transaction_id, position)
VALUES (%(order_id)s, %(customer_id)s, %(amount_cents)s, %(status)s, %(carrier)s,
        %(transaction_id)s, %(position)s)
ON CONFLICT (order_id) DO UPDATE SET
    customer_id = coalesce(EXCLUDED.customer_id, o.customer_id),
    amount_cents = coalesce(EXCLUDED.amount_cents, o.amount_cents),
    status = EXCLUDED.status,
    carrier = coalesce(EXCLUDED.carrier, o.carrier),
    transaction_id = EXCLUDED.transaction_id,
    position = EXCLUDED.position
WHERE (o.transaction_id, o.position) < (EXCLUDED.transaction_id, EXCLUDED.position)
"""
# The events applied; verify --through projection expects them (its reader,
# relay/adapters/postgres/projection.py, names the same types).
_STATUS = {"OrderPlaced": "placed", "OrderShipped": "shipped"}
_PAYLOAD = "order_id string, customer_id string, amount_cents long, carrier string"
# Where an event is in Kafka: how a quarantined one is found again.
_SOURCE = ("topic", "partition", "offset", "key")
# A row's own fault, which Postgres finds: a constraint the DataFrame code does not know
# (a CHECK or a foreign key added to the table), a value it cannot store.
_ROW_FAULTS = (psycopg.DataError, psycopg.IntegrityError)
# The changes of one statement (executemany), in one savepoint: a refused row costs its
# chunk's row-by-row redo, not the batch's.
ROWS_PER_CHUNK = 1_000


def order_changes(events: DataFrame) -> tuple[DataFrame, DataFrame]:
    """Decoded events → ``(changes, quarantined)`` (pure; testable on its own): one change
    row per order event the ``orders`` table can take, and one row per order event it
    cannot, with where it is in Kafka and the ``error`` that says why. Events of other
    types are no order changes: neither."""
    judged = _judged(events)
    change = ["order_id", "customer_id", "amount_cents", "status", "carrier"]
    changes = judged.where("error IS NULL").select(*change, "transaction_id", "position", *_SOURCE)
    return changes, judged.where("error IS NOT NULL").select(*_SOURCE, "error")


def _judged(events: DataFrame) -> DataFrame:
    """The order events, each with its change and the reason it cannot be applied (or
    null): every NOT NULL column and type of ``ORDERS_DDL``, checked here."""
    status = F.coalesce(
        *[F.when(F.col("event_type").endswith(t), F.lit(s)) for t, s in _STATUS.items()]
    )
    # from_json gives a null for a value not of the field's type (1.5, "5", 2**70): told
    # apart from an absent one by the raw value.
    raw_amount = F.get_json_object("payload", "$.amount_cents")
    error = (
        F.when(
            F.col("transaction_id").isNull() | F.col("position").isNull(),
            F.lit("no transaction_id or position header: not published by the relay?"),
        )
        .when(~F.col("payload").startswith("{"), F.lit("the payload is not a JSON object"))
        .when(F.col("p.order_id").isNull(), F.lit("no order_id"))
        .when(
            raw_amount.isNotNull() & F.col("p.amount_cents").isNull(),
            F.concat(
                F.lit("amount_cents is not a whole number within bigint: "),
                F.substring(raw_amount, 1, 40),
            ),
        )
    )
    return (
        events.where(F.col("aggregate_type") == "order")
        .withColumn("p", F.from_json("payload", _PAYLOAD))
        .withColumn("status", status)
        .where("status IS NOT NULL")
        .select(
            F.col("p.order_id").alias("order_id"),
            F.col("p.customer_id").alias("customer_id"),
            F.col("p.amount_cents").alias("amount_cents"),
            "status",
            F.col("p.carrier").alias("carrier"),
            "transaction_id",
            "position",
            *_SOURCE,
            error.alias("error"),
        )
    )


def write_changes(
    conn: psycopg.Connection[Any], rows: Iterable[Row], quarantine: Callable[[list[Row]], object]
) -> tuple[int, int]:
    """Upsert ``rows`` (in publication order) a chunk at a time, handing ``quarantine``
    those Postgres refused, as quarantine rows with its reason; returns how many rows
    there were and how many were refused. Each chunk goes in one statement, in a
    savepoint; only a chunk that fails for a row's fault goes again row by row, each in
    a savepoint, leaving out the ones refused."""
    changes = refused = 0
    for chunk in chunks(rows, ROWS_PER_CHUNK):
        rejected = _write_chunk(conn, chunk)
        quarantine(rejected)
        changes, refused = changes + len(chunk), refused + len(rejected)
    return changes, refused


def _write_chunk(conn: psycopg.Connection[Any], chunk: Sequence[Row]) -> list[Row]:
    try:
        with conn.transaction(), conn.cursor() as cursor:
            cursor.executemany(UPSERT, [r.asDict() for r in chunk])
        return []
    except _ROW_FAULTS as exc:
        logger.warning(
            "order_projection: Postgres refused a change (%s): applying its chunk row by "
            "row to quarantine the refused ones",
            _first_line(exc),
            extra=log_extra("spark_projection_row_refused"),
        )
    refused = []
    for row in chunk:
        try:
            with conn.transaction():
                conn.execute(UPSERT, row.asDict())
        except _ROW_FAULTS as exc:
            reason = f"refused by Postgres: {type(exc).__name__}: {_first_line(exc)}"
            refused.append(Row(**{c: row[c] for c in _SOURCE}, error=reason))
    return refused


def _first_line(exc: BaseException) -> str:
    return next(iter(str(exc).strip().splitlines()), type(exc).__name__)


def ensure_tables(url: str) -> None:
    with connect(url, autocommit=True) as conn:
        create_table(conn, ORDERS_DDL, "orders")


class CorruptRecordsError(RelayError):
    """Records that cannot be decoded, under the ``fail`` policy."""


def batch_writer(
    sink: PostgresBatchSink, on_corrupt: str, summary: RunSummary | None = None
) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: changes, and the events that cannot be applied
    (and routed corrupt records), commit in one Postgres transaction with the batch
    marker; the quarantined ones go to the sink's error table with their reason."""
    if on_corrupt not in ("fail", "route"):
        raise ValueError(f"on_corrupt must be 'fail' or 'route', got {on_corrupt!r}")

    reported: list[bool] = []  # the first batch with records says how many were undecodable

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        batch.persist()  # several actions below: read the batch from Kafka once
        try:
            _write(batch, batch_id)
        finally:
            batch.unpersist()

    def _write(batch: DataFrame, batch_id: int) -> None:
        events, corrupt = split_corrupt(batch)
        undecodable = corrupt.agg(F.count("*").alias("n"), F.min("error").alias("first")).first()
        bad, first_error = (undecodable.n, undecodable.first) if undecodable else (0, None)
        if not reported and (records := batch.count()):
            reported.append(True)
            report_decoding("order_projection", records, bad, first_error)
        if bad and on_corrupt == "fail":
            first = corrupt.first()
            assert first is not None  # bad > 0
            raise CorruptRecordsError(
                f"{bad} undecodable records, first {first.topic}[{first.partition}]"
                f"@{first.offset}: {first.error} (use on_corrupt='route' to divert them)"
            )
        changes, quarantined = order_changes(events)
        unapplicable = quarantined.unionByName(corrupt.select(*_SOURCE, "error"))
        outcome: list[int] = []

        def write(conn: psycopg.Connection[Any]) -> int:
            def quarantine(rows: list[Row]) -> None:
                sink.write_corrupt(conn, batch_id, rows)

            # On the driver a partition at a time (publication order), never the batch.
            ordered = local_rows(changes, "transaction_id", "position")
            changed, refused = write_changes(conn, ordered, quarantine)
            unapplied = 0
            for chunk in chunks(local_rows(unapplicable), ROWS_PER_CHUNK):
                quarantine(chunk)
                unapplied += len(chunk)
            outcome[:] = [changed - refused, unapplied + refused]
            return changed + unapplied

        written = sink.commit(batch_id, write, streaming_query_id(batch))
        if summary is not None and written:
            summary.wrote(outcome[0], outcome[1], batch_id)
        elif summary is not None:
            summary.skipped_replay()

    return write_batch


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topic: str,
    database_url: str,
    checkpoint: str,
    schemas: str | None,
    value_format: str = "auto",
    kafka_settings: Mapping[str, KafkaValue] | None = None,
    available_now: bool = False,
    on_corrupt: str = "fail",
    sink: str = "order-projection",
    max_offsets_per_trigger: int | None = MAX_OFFSETS_PER_TRIGGER,
    reset_sink: bool = False,
    registry: RegistryAccess | None = None,
    summary: RunSummary | None = None,
) -> Any:
    """Start the streaming query; returns it. ``reset_sink``: take the sink over from the
    query of an earlier checkpoint (see :mod:`spark_jobs.postgres_sink`); ``summary``:
    told what each batch wrote and quarantined."""
    ensure_tables(database_url)
    writer = PostgresBatchSink(database_url, sink, take_over=reset_sink)
    writer.ensure_tables()
    options = kafka_options(bootstrap_servers, kafka_settings)
    options.update(subscribe=topic, includeHeaders="true")
    source = kafka_stream(spark, options, max_offsets_per_trigger)
    decoded = decode_events(
        source, writer_schemas=schemas, value_format=value_format, registry=registry,
        registry_schemas=planned_schemas(registry, value_format, topic),
    )  # fmt: skip
    stream = decoded.writeStream.foreachBatch(batch_writer(writer, on_corrupt, summary))
    stream = stream.option("checkpointLocation", checkpoint)
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = sink_job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default="outbox.event.order")
    parser.add_argument("--schemas", help=SCHEMAS_HELP)
    parser.add_argument("--on-corrupt", choices=["fail", "route"], default="fail")
    parser.add_argument(
        "--format",
        dest="value_format",
        choices=VALUE_FORMATS,
        default="auto",
        help="The values' format; auto (the default) tells Avro, registry Avro and JSON "
        "apart per record.",
    )
    args = parser.parse_args(argv)
    options = sink_job_options(parser, args)
    registry = registry_access(parser, args)
    schemas = schemas_folder(parser, args.schemas, args.value_format, args.config)
    summary = RunSummary("order_projection")

    def job() -> None:
        query = start(
            job_session("order_projection", args.debug),
            topic=args.topic,
            schemas=schemas,
            value_format=args.value_format,
            on_corrupt=args.on_corrupt,
            registry=registry,
            summary=summary,
            **options,
        )
        await_query(query, summary)

    run("order_projection", args.debug, job, summary)


if __name__ == "__main__":
    main()
