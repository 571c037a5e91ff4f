"""``debezium attach|detach``: Debezium-style outbox tables."""

from __future__ import annotations

from typing import Annotated

import typer

from relay.cli.common import (
    DatabaseUrl,
    Schema,
    _settings,
    out,
)

debezium_app = typer.Typer(help="Debezium Outbox Event Router compatibility.")


@debezium_app.command("attach")
def debezium_attach(
    ctx: typer.Context,
    table: Annotated[
        str, typer.Argument(help="The Debezium-style outbox table, e.g. public.outbox_events.")
    ],
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            "-o",
            help="An Event Router or converter option by its Debezium name, NAME=VALUE "
            "(repeatable): table.field.event.id|key|type|payload|timestamp, route.by.field, "
            "route.topic.replacement, table.fields.additional.placement, "
            "route.tombstone.on.empty.payload, table.op.invalid.behavior, "
            "table.expand.json.payload, key.converter, value.converter (+ .schemas.enable). "
            "A 'transforms.<name>.' prefix is accepted, so connector settings paste as they are.",
        ),
    ] = None,
    cut_over: Annotated[
        str | None,
        typer.Option(
            help="Switch over from a running Debezium: the name of its publication, which "
            "the table leaves in the same transaction (see deploy/README.md).",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Publish rows apps insert into a Debezium-style table (id, aggregatetype,
    aggregateid, type, payload), unchanged apps included; subscribe with
    `--format debezium` for the Event Router's records."""
    from relay import wiring
    from relay.ops.debezium import attach, parse_options

    options = parse_options(option or [])
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with wiring.connect(settings) as conn:
        switched_at = attach(
            conn, settings.database_schema, table, options, cut_over_publication=cut_over
        )
    out.print(f"inserts into {table} now reach the relay's outbox in {settings.database_schema!r}")
    if switched_at is not None:
        out.print(
            f"{table} left publication {cut_over!r} at WAL position {switched_at}: once "
            "Debezium's slot has confirmed_flush_lsn >= that position, stop Debezium and "
            "resume the relay's subscriber"
        )
        typer.echo(f"cut-over-lsn={switched_at}")


@debezium_app.command("detach")
def debezium_detach(
    ctx: typer.Context,
    table: Annotated[str, typer.Argument(help="A table `debezium attach` attached.")],
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Stop copying inserts into TABLE to the relay's outbox (rows copied stay)."""
    from relay import wiring
    from relay.ops.debezium import detach

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with wiring.connect(settings) as conn:
        detach(conn, settings.database_schema, table)
    out.print(f"inserts into {table} no longer reach the relay's outbox")
