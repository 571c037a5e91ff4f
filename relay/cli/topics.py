"""``topics list|create``: Kafka topics with the relay's Kafka settings."""

from __future__ import annotations

from typing import Annotated, Any

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

topics_app = typer.Typer(
    help="List and create Kafka topics with the relay's Kafka settings (no Kafka CLI needed).",
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
