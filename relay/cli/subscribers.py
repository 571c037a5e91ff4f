"""``subscribers add|list|pause|resume|reset|skip|history|remove``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional
from uuid import UUID

import typer
from rich.table import Table
from rich.text import Text

from relay.cli.backlog import SkipLine, events, print_estimate_note, print_skips, skipped
from relay.cli.common import (
    Bootstrap,
    DatabaseUrl,
    JsonFlag,
    Schema,
    _settings,
    _store,
    err,
    out,
    print_json,
)
from relay.cli.interventions import DryRun, Yes, actor, gate, print_ledger, print_operator_skips
from relay.core import subscribers as subs
from relay.core.interventions import OperatorSkip
from relay.core.model import Position
from relay.core.redact import redact
from relay.core.routing import DEFAULT_KEY
from relay.core.settings import Settings
from relay.errors import BrokerUnavailable, ConfigError, SchemaRegistryUnavailable
from relay.ops import interventions
from relay.ops.lag import SubscriberStatus, subscriber_statuses

subscribers_app = typer.Typer(
    help="Create, inspect, pause and rewind subscribers.", no_args_is_help=True
)


@subscribers_app.command("add")
def subscribers_add(
    ctx: typer.Context,
    name: str,
    topic: Annotated[
        str, typer.Option(help="Topic template: {aggregate_type}, {event_type}.")
    ] = subs.DEFAULT_TOPIC,
    value_format: Annotated[
        Optional[subs.ValueFormat],  # noqa: UP045
        typer.Option(
            "--format",
            help="Value encoding [avro when schemas_dir is configured, else json]; avro "
            "needs the schemas folder, avro-registry that and schema_registry_url.",
            show_default=False,
        ),
    ] = None,
    aggregate_type: Annotated[
        list[str] | None, typer.Option(help="Only these aggregate types (repeatable).")
    ] = None,
    event_type: Annotated[
        list[str] | None, typer.Option(help="Only these event types (repeatable).")
    ] = None,
    start: Annotated[
        subs.StartFrom, typer.Option("--from", help="Where a new subscriber starts.")
    ] = subs.StartFrom.BEGINNING,
    replace: Annotated[
        bool, typer.Option(help="Update an existing subscriber's definition.")
    ] = False,
    parts: Annotated[
        int,
        typer.Option(
            min=1, max=subs.MAX_PARTS, help="Shard over relays by aggregate_id (fixed at creation)."
        ),
    ] = 1,
    on_poison: Annotated[
        subs.PoisonPolicy, typer.Option(help="What to do with an event that cannot be published.")
    ] = subs.PoisonPolicy.HALT,
    dead_letter_topic: Annotated[
        str | None,
        typer.Option(
            help="Dead-letter topic [outbox.dead-letter.<name>] (with --on-poison dead-letter)."
        ),
    ] = None,
    subject_strategy: Annotated[
        subs.SubjectStrategy,
        typer.Option(
            help="avro-registry: register schemas under <topic>-value (topic), the "
            "record's full name (record) or <topic>-<record> (topic-record)."
        ),
    ] = subs.SubjectStrategy.TOPIC,
    key: Annotated[
        str,
        typer.Option(
            help="Record key: a template over aggregate_id, aggregate_type, event_type, "
            "message_id, aggregate_version, occurred_at, payload.<field>, headers.<name>."
        ),
    ] = DEFAULT_KEY,
    partition_by: Annotated[
        str | None,
        typer.Option(
            help="A field whose number is the record's partition [by key]; needs "
            "--partition-count and the broker (to check the topics' partitions)."
        ),
    ] = None,
    partition_count: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="With --partition-by: its values are 0 to N-1, and the subscriber's "
            "topics must have N partitions (those that exist, or topic_partitions).",
        ),
    ] = None,
    placement: Annotated[
        list[str] | None,
        typer.Option(
            help="field:header[:alias] or field:envelope[:alias] (json only); repeatable."
        ),
    ] = None,
    key_format: Annotated[
        subs.KeyFormat,
        typer.Option(
            help="The record key: the aggregate_id as text (string), or as an Avro string "
            "registered under <topic>-key (avro-registry; with --format avro-registry)."
        ),
    ] = subs.KeyFormat.STRING,
    schemas_dir: Annotated[
        Path | None, typer.Option(help="Avro schemas folder [RELAY_SCHEMAS_DIR]")
    ] = None,
    schema_registry_url: Annotated[
        str | None,
        typer.Option(help="Schema registry of avro-registry [RELAY_SCHEMA_REGISTRY_URL]"),
    ] = None,
    bootstrap_servers: Bootstrap = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Add a subscriber (a running relay picks it up within seconds)."""
    if dead_letter_topic is not None and on_poison is not subs.PoisonPolicy.DEAD_LETTER:
        raise typer.BadParameter(
            "a dead-letter topic is used only with --on-poison dead-letter; add it, or drop "
            "--dead-letter-topic",
            param_hint="--dead-letter-topic",
        )
    settings = _settings(
        ctx,
        database_url=database_url,
        database_schema=schema,
        schemas_dir=schemas_dir,
        schema_registry_url=schema_registry_url,
        bootstrap_servers=bootstrap_servers,
    )
    value_format = _value_format(value_format, settings, name)
    subscriber = subs.Subscriber.from_dict(
        {
            "name": name,
            "topic": topic,
            "value_format": value_format,
            "aggregate_types": aggregate_type or None,  # no option given: every type
            "event_types": event_type or None,
            "parts": parts,
            "on_poison": on_poison,
            "dead_letter_topic": dead_letter_topic,
            "subject_strategy": subject_strategy,
            "key": key,
            "partition_by": partition_by,
            "partition_count": partition_count,
            "placements": placement or (),
            "key_format": key_format,
        }
    )
    if subscriber.value_format is subs.ValueFormat.AVRO_REGISTRY:
        _check_registry(settings, subscriber)
    _check_partitions(settings, subscriber)
    with _store(settings) as store:
        created = interventions.add(store, subscriber, start, actor(), replace=replace)
        if parts > 1:
            out.print(f"indexing its {parts} parts (waits for open transactions to end)")
            store.index_parts()
    out.print(f"{'added' if created else 'updated'} subscriber {name!r}")


def _check_partitions(settings: Settings, subscriber: subs.Subscriber) -> None:
    """Refuse a partition field whose range the subscriber's topics do not have, or
    cannot be shown to have (no broker to ask): each of its rows beyond would be poison."""
    if subscriber.partition_count is None:
        return
    from relay.adapters.kafka.topics import partition_room_refusal

    why = "--partition-by: the partitions of the subscriber's topics must be checked"
    try:
        refusal = partition_room_refusal(settings, [subscriber])
    except ConfigError as exc:
        raise ConfigError(f"{why}, which needs the broker: {exc}") from exc
    except BrokerUnavailable as exc:
        raise ConfigError(f"{why}, and the broker does not answer: {redact(str(exc))}") from exc
    if refusal is not None:
        raise ConfigError(f"subscriber {refusal[0]!r}: {refusal[1]}")


def _check_registry(settings: Settings, subscriber: subs.Subscriber) -> None:
    """Refuse (exit 2) a subscriber whose schemas the registry's compatibility rules
    refuse, naming the subject, its versions and the registry's reason; print what
    was checked and what only the first publish can check. A registry that cannot
    answer is a warning."""
    from relay.adapters.registry.registry_compat import check_subscriber
    from relay.adapters.registry.registry_format import encoder_for
    from relay.daemon.startup import load_schemas

    schemas = load_schemas(settings)
    encoder = encoder_for(settings, schemas)
    assert schemas is not None and encoder is not None  # _value_format checked the keys
    try:
        report = check_subscriber(encoder.client, schemas, subscriber)
    except SchemaRegistryUnavailable as exc:
        # As at start-up: the relay checks again when it registers (a refusal halts
        # the part), and an outage of the registry should not block a definition.
        err.print(f"warning: schemas not checked against the registry: {redact(str(exc))}")
        return
    for line in report.checked:
        out.print(f"schema registry: {line}")
    for line in report.unchecked:
        out.print(f"schema registry: not checked before the first publish: {line}")


def _value_format(
    given: subs.ValueFormat | None, settings: Settings, name: str
) -> subs.ValueFormat:
    """The format asked for, else Avro when writer schemas are configured (as for the
    relay's own subscribers). Avro without them would fail every event: refused here,
    naming the key, rather than found by the relay."""
    if given is None:
        return subs.ValueFormat.AVRO if settings.schemas_dir else subs.ValueFormat.JSON
    if given is subs.ValueFormat.AVRO and settings.schemas_dir is None:
        raise ConfigError(
            f"subscriber {name!r}: the avro format needs the writer schemas, and schemas_dir "
            "is not configured (config file, RELAY_SCHEMAS_DIR or --schemas-dir); configure "
            "it as the relay has it, or use --format json"
        )
    if given is subs.ValueFormat.AVRO_REGISTRY:
        missing = settings.registry_format_missing()
        if missing:
            raise ConfigError(f"subscriber {name!r}: the avro-registry format needs {missing}")
    return given


@subscribers_app.command("list")
def subscribers_list(
    ctx: typer.Context,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """List subscribers with their checkpoints and lag."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        statuses = subscriber_statuses(store)
        skips = interventions.operator_skips(store, [s.state.subscriber_id for s in statuses])
    rows = [_listed(status, skips[status.state.subscriber_id]) for status in statuses]
    if as_json:
        print_json(rows)
        return
    table = Table(
        "name", "topic", "format", "filter", "state", "parts", "checkpoint", "lag (events)",
        "skipped by operator",
    )  # fmt: skip
    for r, status in zip(rows, statuses, strict=True):
        flt = [f"{k}={','.join(r[k])}" for k in ("aggregate_types", "event_types") if r[k]]
        halted = [p for p in r["parts"] if p["halted"]]
        state = "paused" if r["paused"] else ("halted" if halted else "active")
        state = "BEYOND HORIZON" if r["beyond_horizon"] else state
        claimed = sum(1 for p in r["parts"] if p["owner"])
        table.add_row(
            *(str(r[k]) for k in ("name", "topic", "format")),
            "; ".join(flt) or "all",
            state,
            f"{len(r['parts'])} ({claimed} claimed)",
            r["checkpoint"],
            events(status.lag),
            skipped(status.skipped),
        )
    out.print(table)
    print_estimate_note(s.lag for s in statuses)
    print_skips(
        [SkipLine(s.state.subscriber.name, str(s.state.checkpoint), s.skipped) for s in statuses]
    )
    for status in statuses:
        print_operator_skips(status.state.subscriber.name, skips[status.state.subscriber_id])
    for r in rows:
        for p in r["parts"]:
            if p["halted"]:
                err.print(
                    Text.assemble((f"{r['name']}/{p['part']} halted:", "red"), " ", p["halted"])
                )


def _listed(status: SubscriberStatus, skips: list[OperatorSkip]) -> dict[str, Any]:
    """A subscriber as ``subscribers list`` shows it."""
    definition = status.state.subscriber.as_dict()
    return {
        "name": definition["name"],
        "topic": definition["topic"],
        "format": definition["value_format"],
        "subject_strategy": definition["subject_strategy"],
        "key": definition["key"],
        "partition_by": definition["partition_by"],
        "partition_count": definition["partition_count"],
        "placements": definition["placements"],
        "key_format": definition["key_format"],
        "aggregate_types": definition["aggregate_types"] or None,
        "event_types": definition["event_types"] or None,
        "paused": definition["paused"],
        "on_poison": definition["on_poison"],
        "checkpoint": str(status.state.checkpoint),
        "lag_events": status.lag.events,
        "lag_estimated": status.lag.estimated,
        "skipped_by_operator": status.skipped.events,
        "skipped_by_reset": status.skipped.by_reset,
        "skipped_by_skip": status.skipped.by_skip,
        "skipped_at_least": status.skipped.at_least,
        "beyond_horizon": status.skipped.beyond_horizon,
        "skips": [k.as_dict() for k in skips],
        "parts": [
            {
                "part": p.part,
                "checkpoint": str(p.checkpoint),
                "owner": None if p.owner is None else str(p.owner),
                "halted": p.halted_error,
                "updated_at": p.updated_at.isoformat(),
            }
            for p in status.state.parts
        ],
    }


@subscribers_app.command("pause")
def subscribers_pause(
    ctx: typer.Context, name: str, database_url: DatabaseUrl = None, schema: Schema = None
) -> None:
    """Stop publishing for a subscriber (others continue)."""
    _set_paused(ctx, name, True, database_url, schema)


@subscribers_app.command("resume")
def subscribers_resume(
    ctx: typer.Context, name: str, database_url: DatabaseUrl = None, schema: Schema = None
) -> None:
    """Resume a paused subscriber, or one halted by a poison event, from its checkpoint."""
    _set_paused(ctx, name, False, database_url, schema)


@subscribers_app.command("reset")
def subscribers_reset(
    ctx: typer.Context,
    name: str,
    to: Annotated[
        str, typer.Option(help="'beginning', 'now', or TRANSACTION_ID:POSITION (resume after it).")
    ],
    dry_run: DryRun = False,
    yes: Yes = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Move a subscriber's checkpoints: skips or republishes events, which it counts
    first (--dry-run: only that). To skip one event, use `subscribers skip`."""
    target: subs.StartFrom | Position
    if to in (subs.StartFrom.BEGINNING.value, subs.StartFrom.NOW.value):
        target = subs.StartFrom(to)
    else:
        try:
            target = Position.parse(to)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--to") from exc
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        moves = interventions.reset(store, name, target, actor(), gate(dry_run=dry_run, yes=yes))
    if moves is not None:
        out.print(f"subscriber {name!r} reset to {to}")
        for move in moves:
            out.print(f"  {move.describe()}")


@subscribers_app.command("skip")
def subscribers_skip(
    ctx: typer.Context,
    name: str,
    event: Annotated[
        list[str],
        typer.Option(
            "--event",
            help="The message id of an event to skip (repeatable); a halt's error names it.",
            show_default=False,
        ),
    ],
    dry_run: DryRun = False,
    yes: Yes = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Skip exactly these events (not yet published) of a halted or running subscriber:
    every other event is published. A part halted on one of them resumes."""
    try:
        ids = [UUID(e) for e in event]
    except ValueError as exc:
        raise typer.BadParameter(f"not a message id (a UUID): {exc}", param_hint="--event") from exc
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        done = interventions.skip(store, name, ids, actor(), gate(dry_run=dry_run, yes=yes))
    if done is None:
        return
    out.print(f"subscriber {name!r}: {done.events} event(s) skipped")
    for part in done.resumed:
        out.print(f"  part {part} resumed (it was halted on a skipped event)")
    for part, error in done.still_halted.items():
        err.print(Text.assemble((f"{name}/{part} still halted:", "red"), " ", error))


@subscribers_app.command("history")
def subscribers_history(
    ctx: typer.Context,
    name: str,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """The ledger of a subscriber's interventions (removed subscribers of that name
    too): who, when, what and how many events."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        entries = interventions.history(store, name)
    if as_json:
        print_json([e.as_dict() for e in entries])
        return
    print_ledger(entries)


@subscribers_app.command("remove")
def subscribers_remove(
    ctx: typer.Context, name: str, database_url: DatabaseUrl = None, schema: Schema = None
) -> None:
    """Delete a subscriber and its checkpoint (the ledger keeps its history)."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        interventions.remove(store, name, actor())
    out.print(f"removed subscriber {name!r}")


def _set_paused(
    ctx: typer.Context, name: str, paused: bool, database_url: str | None, schema: str | None
) -> None:
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        cleared = interventions.set_paused(store, name, paused, actor())
    out.print(f"subscriber {name!r} {'paused' if paused else 'resumed'}")
    for part, error in cleared.items():
        out.print(f"  part {part}: cleared its halt ({error})")
