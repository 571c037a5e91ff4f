"""``topics list|create|tail``: Kafka topics with the relay's Kafka settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from relay.cli.common import (
    Bootstrap,
    JsonFlag,
    _settings,
    err,
    out,
    print_json,
)
from relay.core.settings import Settings

if TYPE_CHECKING:
    from relay.core.value_decoding import Decoded
    from relay.ops.tail import TailedRecord

topics_app = typer.Typer(
    help="List, create and read Kafka topics with the relay's Kafka settings (no Kafka CLI "
    "needed).",
    no_args_is_help=True,
)


def _admin(ctx: typer.Context, bootstrap_servers: str | None) -> tuple[Any, Settings]:
    from relay.adapters.kafka.topics import admin_client

    settings = _settings(ctx, bootstrap_servers=bootstrap_servers)
    return admin_client(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
    ), settings


@topics_app.command("list")
def topics_list(
    ctx: typer.Context,
    internal: Annotated[
        bool, typer.Option("--internal", help="Also Kafka's own topics (__consumer_offsets...).")
    ] = False,
    as_json: JsonFlag = False,
    bootstrap_servers: Bootstrap = None,
) -> None:
    """The cluster's topics, with partitions and replication factor."""
    from relay.adapters.kafka.topics import list_topics

    admin, _ = _admin(ctx, bootstrap_servers)
    topics = list_topics(admin, internal=internal)
    if as_json:
        print_json([t.as_dict() for t in topics])
        return
    table = Table("topic", "partitions", "replication factor")
    for t in topics:
        table.add_row(t.name, str(t.partitions), str(t.replication_factor))
    out.print(table)


@topics_app.command("create")
def topics_create(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(help="Topic names.")],
    partitions: Annotated[
        int | None, typer.Option(min=1, help="Partitions [RELAY_TOPIC_PARTITIONS, 3].")
    ] = None,
    replication_factor: Annotated[
        int | None,
        typer.Option(
            min=-1, help="Replicas; -1: the broker's default [RELAY_TOPIC_REPLICATION_FACTOR]."
        ),
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config", help="Topic setting KEY=VALUE (repeatable), e.g. cleanup.policy=compact."
        ),
    ] = None,
    if_not_exists: Annotated[
        bool, typer.Option("--if-not-exists", help="A topic that exists already is no error.")
    ] = False,
    bootstrap_servers: Bootstrap = None,
) -> None:
    """Create topics (exits 1 if one exists, unless --if-not-exists)."""
    from relay.adapters.kafka.topics import create_topics, parse_config

    settings_config = parse_config(config or [])
    admin, settings = _admin(ctx, bootstrap_servers)
    created = create_topics(
        admin,
        names,
        partitions=partitions or settings.topic_partitions,
        replication_factor=(
            settings.topic_replication_factor if replication_factor is None else replication_factor
        ),
        config=settings_config,
    )
    for name, new in created.items():
        out.print(f"{'created' if new else 'exists'}: {name}")
    if not if_not_exists and not all(created.values()):
        err.print("some topics existed already (--if-not-exists accepts that)")
        raise typer.Exit(1)


@topics_app.command("tail")
def topics_tail(
    ctx: typer.Context,
    topics: Annotated[list[str], typer.Argument(help="Topics to read.")],
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Every record, not only those to come.")
    ] = False,
    max_records: Annotated[
        int | None, typer.Option("--max", min=0, help="Stop after N records.")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(min=0, help="Stop after SECONDS without a record (else: until Ctrl-C)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per record and line.")
    ] = False,
    schemas_dir: Annotated[
        Path | None,
        typer.Option(help="Writer schemas of avro values [RELAY_SCHEMAS_DIR]."),
    ] = None,
    schema_registry_url: Annotated[
        str | None,
        typer.Option(help="Registry of avro-registry values [RELAY_SCHEMA_REGISTRY_URL]."),
    ] = None,
    bootstrap_servers: Bootstrap = None,
) -> None:
    """Print the records committed to TOPICS as they come (read_committed), each key
    and value decoded: avro (with the schemas folder), avro-registry (with the
    registry), JSON or text; bytes otherwise, with the reason."""
    from relay.core.value_decoding import decode
    from relay.ops.subscribers import load_schemas
    from relay.ops.tail import tail
    from relay.wiring import topic_reader, writer_lookup

    settings = _settings(
        ctx,
        bootstrap_servers=bootstrap_servers,
        schemas_dir=schemas_dir,
        schema_registry_url=schema_registry_url,
    )
    schemas, by_id = load_schemas(settings), writer_lookup(settings)
    reader = topic_reader(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()},
        group="outbox-relay-tail",
    )
    records = tail(
        reader,
        topics,
        lambda data: decode(data, schemas, by_id),
        from_beginning=from_beginning,
        limit=max_records,
        idle_timeout=timeout,
    )
    try:
        for record in records:
            _print_tailed(record, as_json)
    except KeyboardInterrupt:
        return  # Ctrl-C ends a tail: no error


def _print_tailed(record: TailedRecord, as_json: bool) -> None:
    if as_json:
        print_json(record.as_dict(), indent=None)
        sys.stdout.flush()  # each record as it comes, through a pipe too
        return
    out.print(f"{record.topic}[{record.partition}]@{record.offset}", soft_wrap=True)
    out.print(f"  key: {_shown(record.key)}", soft_wrap=True)
    for name, value in record.headers:
        out.print(f"  header {name}: {value}", soft_wrap=True)
    out.print(f"  value: {_shown(record.value)}", soft_wrap=True)


def _shown(decoded: Decoded) -> str:
    """A decoded key or value on one line, with its encoding (and why it is bytes)."""
    content = decoded.content
    text = content if isinstance(content, str) else json.dumps(content, default=str)
    named = decoded.encoding if decoded.schema is None else f"{decoded.encoding} {decoded.schema}"
    why = "" if decoded.problem is None else f" ({decoded.problem})"
    return f"({named}{why}) {text}"
