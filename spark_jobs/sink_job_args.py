"""The command line every Kafka → Postgres-sink job shares (order projection, window
average): its options, and ``start``'s keywords from them. Each job adds its own options
to the parser and passes its own keywords next to these."""

from __future__ import annotations

import argparse
from typing import TypedDict

from relay.core.settings import KafkaValue
from spark_jobs.database_url import DATABASE_URL_HELP, resolve_database_url
from spark_jobs.job import (
    add_batch_limit_option,
    add_common_options,
    kafka_clients,
    max_offsets_per_trigger,
)
from spark_jobs.postgres_sink import RESET_SINK_HELP
from spark_jobs.preflight import checkpoint_folder


class SinkJobOptions(TypedDict):
    """The keywords of a sink job's ``start`` that come from the shared options."""

    bootstrap_servers: str
    kafka_settings: dict[str, KafkaValue]
    database_url: str
    checkpoint: str
    available_now: bool
    max_offsets_per_trigger: int | None
    reset_sink: bool


def sink_job_parser(description: str) -> argparse.ArgumentParser:
    """A parser holding the shared options; the job adds its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    add_common_options(parser)
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--available-now", action="store_true", help="Process what is there, stop.")
    add_batch_limit_option(parser)
    parser.add_argument("--reset-sink", action="store_true", help=RESET_SINK_HELP)
    return parser


def sink_job_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SinkJobOptions:
    """``start``'s shared keywords. The database URL comes from the flag, or else from the
    environment (secrets stay out of argv); none at all is a usage error of ``parser``.
    The Kafka client settings are the relay's (:func:`spark_jobs.job.kafka_clients`).
    Each is checked here, before Spark starts."""
    return SinkJobOptions(
        bootstrap_servers=args.bootstrap_servers,
        kafka_settings=dict(kafka_clients(parser, args).settings),
        database_url=resolve_database_url(parser, args.database_url),
        checkpoint=checkpoint_folder(parser, args.checkpoint, "--checkpoint"),
        available_now=args.available_now,
        max_offsets_per_trigger=max_offsets_per_trigger(args),
        reset_sink=args.reset_sink,
    )
