"""``dead-letters list|redrive|prune``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from relay.cli.common import (
    Bootstrap,
    DatabaseUrl,
    JsonFlag,
    Schema,
    _settings,
    err,
    out,
    print_json,
)
from relay.cli.interventions import BatchSize, DryRun, Yes, actor, gate
from relay.ops import interventions

dead_letters_app = typer.Typer(
    help="List a subscriber's dead letters; publish them once their cause is fixed; "
    "delete those past their retention.",
    no_args_is_help=True,
)


@dead_letters_app.command("list")
def dead_letters_list(
    ctx: typer.Context,
    subscriber: Annotated[str, typer.Argument(help="The subscriber.")],
    include_redriven: Annotated[
        bool, typer.Option("--all", help="Also those redriven already.")
    ] = False,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """A subscriber's dead letters, in publication order, with their errors."""
    from relay import wiring

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with wiring.connect(settings) as conn:
        letters = wiring.dead_letter_store(conn, settings.database_schema).dead_letters(
            subscriber, include_redriven=include_redriven
        )
    if as_json:
        print_json([d.as_dict() for d in letters])
        return
    table = Table("key", "part", "message id", "aggregate", "event type", "error", "redrive")
    for d in letters:
        aggregate = (
            "(pruned)" if d.aggregate_type is None else f"{d.aggregate_type}/{d.aggregate_id}"
        )
        redrive = f"redriven {d.redriven_at:%Y-%m-%d %H:%M:%S}" if d.redriven_at else ""
        table.add_row(
            str(d.key), str(d.part), str(d.message_id), aggregate, d.event_type or "-",
            d.error, redrive or d.redrive_error or "-",
        )  # fmt: skip
    out.print(table)
    if not letters:
        err.print(f"no {'' if include_redriven else 'pending '}dead letters for {subscriber!r}")


@dead_letters_app.command("redrive")
def dead_letters_redrive(
    ctx: typer.Context,
    subscriber: Annotated[str, typer.Argument(help="The subscriber.")],
    schemas_dir: Annotated[
        Path | None, typer.Option(help="Avro schemas folder [RELAY_SCHEMAS_DIR]")
    ] = None,
    batch_size: BatchSize = 500,
    as_json: JsonFlag = False,
    dry_run: DryRun = False,
    yes: Yes = False,
    database_url: DatabaseUrl = None,
    bootstrap_servers: Bootstrap = None,
    schema: Schema = None,
) -> None:
    """Publish a subscriber's dead-lettered events, exactly once and in order per key,
    as the relay would publish them now (after a fix: a schema added, say). The live
    checkpoint does not move. Counts them first (--dry-run: only that). Exits 1 when
    some stay dead-lettered (still poison, or behind a still-poison event of their key)."""
    from contextlib import closing, nullcontext

    from relay import wiring
    from relay.ops.redrive import Redrive, group_prefix, relay_encoder

    settings = _settings(
        ctx,
        database_url=database_url,
        bootstrap_servers=bootstrap_servers,
        database_schema=schema,
        schemas_dir=schemas_dir,
    )
    with wiring.connect(settings, "outbox-relay-redrive") as conn:
        store = wiring.dead_letter_store(conn, settings.database_schema)
        state = store.subscriber(subscriber)
        pending = [d.message_id for d in store.dead_letters(subscriber)]
        # Its schemas are checked before the preview: a refusal comes before any question.
        subscribers = (s.subscriber for s in store.outbox.list())
        guard, encoder = relay_encoder(settings, subscribers, wiring.registry_encoder)
        confirm = gate(dry_run=dry_run, yes=yes, machine_output=as_json)
        if not confirm(interventions.redrive_preview(subscriber, pending)):
            return
        record = wiring.topic_record(lambda: nullcontext(conn), settings.database_schema)
        prefix = group_prefix(settings.kafka_id_prefix, state.subscriber_id)
        publisher = wiring.exactly_once_publisher(settings, prefix, guard, record, "redrive")
        with closing(publisher):
            redrive = Redrive(
                store,
                publisher,
                encoder,
                state,
                batch_size=batch_size,
            )
            report = redrive.run()
        interventions.record_redrive(
            store.outbox, subscriber, state.subscriber_id, actor(), report.as_dict()
        )
    if as_json:
        print_json(report.as_dict())
    else:
        _print_redrive(report)
    if report.left:
        raise typer.Exit(1)


@dead_letters_app.command("prune")
def dead_letters_prune(
    ctx: typer.Context,
    subscriber: Annotated[str, typer.Argument(help="The subscriber.")],
    pending_older_than: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Also delete dead letters NOT yet redriven, decided more than this many "
            "seconds ago: they can no longer be redriven (their records stay on the "
            "dead-letter topic). Previewed, confirmed, and on the ledger.",
        ),
    ] = None,
    batch: Annotated[
        int, typer.Option(min=1, help="Redriven dead letters deleted per transaction.")
    ] = 10_000,
    dry_run: DryRun = False,
    yes: Yes = False,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Delete a subscriber's dead letters past their retention: those redriven whose
    outbox rows retention pruned (as the relay's retention pass does). Dead letters not
    yet redriven are kept, with their outbox rows, unless --pending-older-than says
    otherwise: that deletion is shown first and needs --yes (or a yes on a terminal)."""
    from relay import wiring

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with wiring.connect(settings) as conn:
        store = wiring.dead_letter_store(conn, settings.database_schema)
        pending: int | None = None
        if pending_older_than is not None:
            confirm = gate(dry_run=dry_run, yes=yes, machine_output=as_json)
            pending = interventions.prune_pending(
                store, subscriber, pending_older_than, actor(), confirm
            )
            if pending is None:
                return
        redriven = 0 if dry_run else store.prune(subscriber, batch=batch)
    _print_prune(subscriber, redriven, pending, pending_older_than, as_json=as_json)


def _print_prune(
    subscriber: str, redriven: int, pending: int | None, older_than: float | None, *, as_json: bool
) -> None:
    if as_json:
        print_json({"subscriber": subscriber, "redriven": redriven, "pending": pending or 0})
        return
    out.print(f"{subscriber}: pruned {redriven} redriven dead letters")
    if pending is not None:
        out.print(
            f"{subscriber}: pruned {pending} dead letters not redriven, decided more than "
            f"{older_than:g} s ago: they can no longer be redriven"
        )


def _print_redrive(report: Any) -> None:
    out.print(f"{report.subscriber}: redriven {report.redriven}")
    if report.recovered:
        out.print(f"recorded {report.recovered} redriven by an earlier redrive that stopped")
    for message_id, error in report.still_poison.items():
        err.print(
            Text.assemble(("still poison, stays dead-lettered: ", "red"), f"{message_id}: {error}")
        )
    if report.held_back:
        err.print(
            f"{len(report.held_back)} held back behind a still-poison event of their key "
            "(redriven, in order, once it is fixed)"
        )
    if report.missing:
        err.print(f"{len(report.missing)} whose outbox rows were pruned: cannot be redriven")
