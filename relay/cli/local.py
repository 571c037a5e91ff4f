"""The local stack: ``dev`` (with the demo writer) and ``local`` (servers only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from relay.observability import logs


def dev(
    workdir: Annotated[
        Path, typer.Option(help="Where the local Postgres and Kafka keep their data.")
    ] = Path(".outbox-relay"),
    rate: Annotated[float, typer.Option(help="Demo events written per second.", min=0)] = 200.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds.", min=0)
    ] = None,
    schemas_dir: Annotated[Path, typer.Option(help="Avro schemas folder.")] = Path("schemas"),
) -> None:
    """The embedded stack: local Postgres and Apache Kafka, migrations, relay, demo writer, live output."""
    from relay.localstack.demo import run_dev

    logs.configure("WARNING")
    run_dev(workdir=workdir, rate=rate, duration=duration, schemas_dir=schemas_dir)


def local(
    workdir: Annotated[Path, typer.Option(help="Where the local servers keep their data.")] = Path(
        ".outbox-relay"
    ),
    database: Annotated[str, typer.Option(help="Database to create and migrate.")] = "outbox",
    postgres_port: Annotated[
        int | None, typer.Option(help="Postgres port (default: a free one).", min=1, max=65535)
    ] = None,
    kafka_port: Annotated[
        int | None,
        typer.Option(help="Kafka port on first start (default: a free one).", min=1, max=65535),
    ] = None,
    registry: Annotated[
        bool,
        typer.Option(
            "--registry",
            help="Also a schema registry (Apicurio; built once with Maven), for avro-registry.",
        ),
    ] = False,
) -> None:
    """Local Postgres and Apache Kafka for your own app: the demo's stack, no demo writer."""
    from relay.localstack.stack import run_local

    logs.configure("INFO")
    run_local(
        workdir=workdir,
        database=database,
        postgres_port=postgres_port,
        kafka_port=kafka_port,
        registry=registry,
    )
