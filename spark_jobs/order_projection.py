"""Job (a): keep an ``orders`` read model in Postgres up to date from the order events.

Exactly once end to end: the Kafka source's offsets live in the Spark checkpoint, and
each micro-batch commits in one Postgres transaction with its batch marker
(:class:`PostgresBatchSink`). On top of that, every upsert is guarded by the event's
``(transaction_id, position)``, the relay's publication order, so even a replay from an
older checkpoint can never move an order's state backwards.

Run locally (embedded default) or with ``spark-submit``::

    RELAY_DATABASE_URL_FILE=/run/secrets/db-url \\
    python -m spark_jobs.order_projection --bootstrap-servers 127.0.0.1:9092 \\
        --checkpoint /tmp/orders-ckpt

(``--database-url`` works too, but shows the password in ``ps``.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F

from relay.core.settings import KafkaValue
from relay.errors import RelayError
from spark_jobs.decoding import VALUE_FORMATS, decode_events, split_corrupt
from spark_jobs.job import await_query, job_session, registry_access, report_decoding, run
from spark_jobs.postgres_sink import PostgresBatchSink, connect, create_table
from spark_jobs.registry_schemas import RegistryAccess, planned_schemas
from spark_jobs.sink_job_args import sink_job_options, sink_job_parser
from spark_jobs.spark_session import kafka_options, streaming_query_id

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
_STATUS = {"OrderPlaced": "placed", "OrderShipped": "shipped"}


def order_changes(events: DataFrame) -> DataFrame:
    """Decoded events → one change row per order event (pure; testable on its own)."""
    payload = F.from_json(
        "payload", "order_id string, customer_id string, amount_cents long, carrier string"
    )
    status = F.coalesce(
        *[F.when(F.col("event_type").endswith(t), F.lit(s)) for t, s in _STATUS.items()]
    )
    return (
        events.where(F.col("aggregate_type") == "order")
        .withColumn("p", payload)
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
        )
    )


def write_changes(conn: psycopg.Connection[Any], rows: Sequence[Row]) -> None:
    ordered = sorted(rows, key=lambda r: (r.transaction_id, r.position))
    with conn.cursor() as cursor:
        cursor.executemany(UPSERT, [r.asDict() for r in ordered])


def ensure_tables(url: str) -> None:
    with connect(url, autocommit=True) as conn:
        create_table(conn, ORDERS_DDL, "orders")


class CorruptRecordsError(RelayError):
    """Records that cannot be decoded, under the ``fail`` policy."""


def batch_writer(sink: PostgresBatchSink, on_corrupt: str) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: changes (and routed corrupt records) commit in one
    Postgres transaction with the batch marker."""
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
        bad = corrupt.collect()
        if not reported and (records := batch.count()):
            reported.append(True)
            first_error = min((r.error for r in bad), default=None)
            report_decoding("order_projection", records, len(bad), first_error)
        if bad and on_corrupt == "fail":
            first = bad[0]
            raise CorruptRecordsError(
                f"{len(bad)} undecodable records, first {first.topic}[{first.partition}]"
                f"@{first.offset}: {first.error} (use on_corrupt='route' to divert them)"
            )
        changes = order_changes(events).collect()

        def write(conn: psycopg.Connection[Any]) -> int:
            write_changes(conn, changes)
            sink.write_corrupt(conn, batch_id, bad)
            return len(changes) + len(bad)

        sink.commit(batch_id, write, streaming_query_id(batch))

    return write_batch


def start(
    spark: Any,
    *,
    bootstrap_servers: str,
    topic: str,
    database_url: str,
    checkpoint: str,
    schemas: str,
    value_format: str = "auto",
    kafka_settings: Mapping[str, KafkaValue] | None = None,
    available_now: bool = False,
    on_corrupt: str = "fail",
    sink: str = "order-projection",
    max_offsets_per_trigger: int | None = None,
    reset_sink: bool = False,
    registry: RegistryAccess | None = None,
) -> Any:
    """Start the streaming query; returns it. ``reset_sink``: take the sink over from the
    query of an earlier checkpoint (see :mod:`spark_jobs.postgres_sink`)."""
    ensure_tables(database_url)
    writer = PostgresBatchSink(database_url, sink, take_over=reset_sink)
    writer.ensure_tables()
    options = kafka_options(bootstrap_servers, kafka_settings)
    if max_offsets_per_trigger:
        options["maxOffsetsPerTrigger"] = str(max_offsets_per_trigger)
    source = (
        spark.readStream.format("kafka")
        .options(subscribe=topic, startingOffsets="earliest", includeHeaders="true", **options)
        .load()
    )
    decoded = decode_events(
        source, writer_schemas=schemas, value_format=value_format, registry=registry,
        registry_schemas=planned_schemas(registry, value_format, topic),
    )  # fmt: skip
    stream = decoded.writeStream.foreachBatch(batch_writer(writer, on_corrupt))
    stream = stream.option("checkpointLocation", checkpoint)
    stream = stream.trigger(availableNow=True) if available_now else stream
    return stream.start()


def main(argv: Sequence[str] | None = None) -> None:
    parser = sink_job_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default="outbox.event.order")
    parser.add_argument("--schemas", default=str(Path("schemas")))
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

    def job() -> None:
        query = start(
            job_session("order_projection", args.debug),
            topic=args.topic,
            schemas=args.schemas,
            value_format=args.value_format,
            on_corrupt=args.on_corrupt,
            registry=registry,
            **options,
        )
        await_query(query)

    run("order_projection", args.debug, job)


if __name__ == "__main__":
    main()
