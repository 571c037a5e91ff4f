"""``subscribers add|set|list|pause|resume|reset|skip|replay|history|remove``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
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
from relay.cli.interventions import (
    BatchSize,
    DryRun,
    Yes,
    actor,
    gate,
    print_ledger,
    print_operator_skips,
)
from relay.core import subscribers as subs
from relay.core.interventions import OperatorSkip
from relay.core.model import Position
from relay.core.routing import DEFAULT_KEY
from relay.core.settings import Settings
from relay.ops import interventions
from relay.ops import subscribers as subscriber_ops
from relay.ops.lag import SubscriberStatus, subscriber_statuses

subscribers_app = typer.Typer(
    help="Create, inspect, pause and rewind subscribers.", no_args_is_help=True
)


# The options of a definition, shared by `add` and `set`, and the field each sets.
Topic = Annotated[str | None, typer.Option(help="Topic template: {aggregate_type}, {event_type}.")]
Format = Annotated[
    Optional[subs.ValueFormat],  # noqa: UP045
    typer.Option(
        "--format",
        help="Value encoding [avro when schemas_dir is configured, else json]; avro "
        "needs the schemas folder, avro-registry that and schema_registry_url.",
        show_default=False,
    ),
]
AggregateTypes = Annotated[
    list[str] | None, typer.Option(help="Only these aggregate types (repeatable).")
]
EventTypes = Annotated[list[str] | None, typer.Option(help="Only these event types (repeatable).")]
OnPoison = Annotated[
    Optional[subs.PoisonPolicy],  # noqa: UP045
    typer.Option(help="What to do with an event that cannot be published."),
]
DeadLetterTopic = Annotated[
    str | None,
    typer.Option(
        help="Dead-letter topic [outbox.dead-letter.<name>] (with --on-poison dead-letter)."
    ),
]
Strategy = Annotated[
    Optional[subs.SubjectStrategy],  # noqa: UP045
    typer.Option(
        help="avro-registry: register schemas under <topic>-value (topic), the "
        "record's full name (record) or <topic>-<record> (topic-record)."
    ),
]
Key = Annotated[
    str | None,
    typer.Option(
        help="Record key: a template over aggregate_id, aggregate_type, event_type, "
        "message_id, aggregate_version, occurred_at, payload.<field>, headers.<name>."
    ),
]
PartitionBy = Annotated[
    str | None,
    typer.Option(
        help="A field whose number is the record's partition [by key]; needs "
        "--partition-count and the broker (to check the topics' partitions)."
    ),
]
PartitionCount = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="With --partition-by: its values are 0 to N-1, and the subscriber's "
        "topics must have N partitions (those that exist, or topic_partitions).",
    ),
]
Placements = Annotated[
    list[str] | None,
    typer.Option(help="field:header[:alias] or field:envelope[:alias] (json only); repeatable."),
]
KeyFormat = Annotated[
    Optional[subs.KeyFormat],  # noqa: UP045
    typer.Option(
        help="The record key: the aggregate_id as text (string), or as an Avro string "
        "registered under <topic>-key (avro-registry; with --format avro-registry)."
    ),
]
SchemasDir = Annotated[Path | None, typer.Option(help="Avro schemas folder [RELAY_SCHEMAS_DIR]")]
RegistryUrl = Annotated[
    str | None, typer.Option(help="Schema registry of avro-registry [RELAY_SCHEMA_REGISTRY_URL]")
]
ApplyYes = Annotated[
    bool,
    typer.Option(
        "--yes",
        help="Apply a change that resets options not given (add --replace) or narrows "
        "the filter (the events it drops are not published by this subscriber).",
    ),
]


@dataclass(frozen=True)
class DefinitionOption:
    """An option of a definition, declared here once for `add` and `set`: its parameter
    (typer option: flag and help), the Subscriber field it sets, and its default on
    `add` (on `set` every one defaults to None: not given)."""

    name: str
    annotation: Any
    field: str
    default: Any = None

    def parameter(self, *, defaults: bool) -> inspect.Parameter:
        default = self.default if defaults else None
        return inspect.Parameter(
            self.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=default,
            annotation=self.annotation,
        )


# In the order `--help` shows them: what a subscriber takes and where it publishes it,
# then how it publishes (`add` puts its own --from, --replace, --yes, --parts between).
WHAT = (
    DefinitionOption("topic", Topic, "topic", subs.DEFAULT_TOPIC),
    DefinitionOption("value_format", Format, "value_format"),
    DefinitionOption("aggregate_type", AggregateTypes, "aggregate_types"),
    DefinitionOption("event_type", EventTypes, "event_types"),
)
HOW = (
    DefinitionOption("on_poison", OnPoison, "on_poison", subs.PoisonPolicy.HALT),
    DefinitionOption("dead_letter_topic", DeadLetterTopic, "dead_letter_topic"),
    DefinitionOption("subject_strategy", Strategy, "subject_strategy", subs.SubjectStrategy.TOPIC),
    DefinitionOption("key", Key, "key", DEFAULT_KEY),
    DefinitionOption("partition_by", PartitionBy, "partition_by"),
    DefinitionOption("partition_count", PartitionCount, "partition_count"),
    DefinitionOption("placement", Placements, "placements"),
    DefinitionOption("key_format", KeyFormat, "key_format", subs.KeyFormat.STRING),
)
GROUPS = {"what": WHAT, "how": HOW}
# The field each option sets; `parts` is `add`'s own (fixed at creation).
FIELDS = {o.name: o.field for o in (*WHAT, *HOW)} | {"parts": "parts"}
# A command's group of definition options, as it receives them: field -> value; the
# parameter's default stands in until definition_options declares the group's options.
Options = Mapping[str, Any]
DECLARED: Options = MappingProxyType({})
Command = Callable[..., None]


def definition_options(*, defaults: bool) -> Callable[[Command], Command]:
    """Gives a command the definition options: each of its parameters named after a
    group of GROUPS (annotated Options) becomes that group's options, with their `add`
    defaults (``defaults``) or None, and comes back to it as one dict field -> value."""

    def declare(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        parameters = [
            declared
            for p in signature.parameters.values()
            for declared in _declared(p, defaults=defaults)
        ]

        @functools.wraps(command)
        def run(**given: Any) -> None:
            for group in GROUPS.keys() & signature.parameters.keys():
                given[group] = {o.field: given.pop(o.name) for o in GROUPS[group]}
            command(**given)

        # typer reads a command's options from its signature.
        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        return run

    return declare


def _declared(parameter: inspect.Parameter, *, defaults: bool) -> list[inspect.Parameter]:
    """A command's parameter as typer is to see it: a group's options, or itself."""
    group = GROUPS.get(parameter.name)
    if group is None:
        return [parameter]
    return [option.parameter(defaults=defaults) for option in group]


class Unset(StrEnum):
    """The options `subscribers set --unset` sets back to their defaults."""

    TOPIC = "topic"
    FORMAT = "format"
    AGGREGATE_TYPE = "aggregate-type"
    EVENT_TYPE = "event-type"
    ON_POISON = "on-poison"
    DEAD_LETTER_TOPIC = "dead-letter-topic"
    SUBJECT_STRATEGY = "subject-strategy"
    KEY = "key"
    PARTITION_BY = "partition-by"
    PARTITION_COUNT = "partition-count"
    PLACEMENT = "placement"
    KEY_FORMAT = "key-format"

    @property
    def field(self) -> str:
        return FIELDS["value_format" if self is Unset.FORMAT else self.value.replace("-", "_")]


@subscribers_app.command("add")
@definition_options(defaults=True)
def subscribers_add(
    ctx: typer.Context,
    name: str,
    what: Options = DECLARED,
    start: Annotated[
        subs.StartFrom, typer.Option("--from", help="Where a new subscriber starts.")
    ] = subs.StartFrom.BEGINNING,
    replace: Annotated[
        bool,
        typer.Option(
            help="Define an existing subscriber anew: the options not given take their "
            "defaults (shown, and applied with --yes only; `subscribers set` changes "
            "only the options given)."
        ),
    ] = False,
    yes: ApplyYes = False,
    parts: Annotated[
        int,
        typer.Option(
            min=1, max=subs.MAX_PARTS, help="Shard over relays by aggregate_id (fixed at creation)."
        ),
    ] = 1,
    how: Options = DECLARED,
    schemas_dir: SchemasDir = None,
    schema_registry_url: RegistryUrl = None,
    bootstrap_servers: Bootstrap = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Add a subscriber (a running relay picks it up within seconds)."""
    options = {"name": name, **what, "parts": parts, **how}
    settings = _definition_settings(ctx, database_url, schema, schemas_dir, schema_registry_url,
                                    bootstrap_servers)  # fmt: skip
    with _store(settings) as store:
        outcome = subscriber_ops.add(
            _definition_setup(settings), store, options, start=start, replace=replace, given=_given(ctx),
            yes=yes, indexing=_indexing, actor=actor(),
        )  # fmt: skip
    _print_outcome(outcome)
    if outcome.change.changed and not outcome.applied:
        raise typer.Exit(2)


@subscribers_app.command("set")
@definition_options(defaults=False)
def subscribers_set(
    ctx: typer.Context,
    name: str,
    what: Options = DECLARED,
    how: Options = DECLARED,
    unset: Annotated[
        list[Unset] | None,
        typer.Option(help="Set this option back to its default (repeatable).", show_default=False),
    ] = None,
    yes: ApplyYes = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the change; write nothing.")
    ] = False,
    schemas_dir: SchemasDir = None,
    schema_registry_url: RegistryUrl = None,
    bootstrap_servers: Bootstrap = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Change only the options given of a subscriber (the rest of its definition, its
    checkpoints and parts stay), checked as `add` checks a new one. A change that
    narrows its filter is applied with --yes only."""
    settings = _definition_settings(ctx, database_url, schema, schemas_dir, schema_registry_url,
                                    bootstrap_servers)  # fmt: skip
    with _store(settings) as store:
        outcome = subscriber_ops.set_options(
            _definition_setup(settings), store, name, {**what, **how}, unset=[u.field for u in unset or ()],
            yes=yes, dry_run=dry_run, actor=actor(),
        )  # fmt: skip
    _print_outcome(outcome, dry_run=dry_run)
    if outcome.change.changed and not outcome.applied and not dry_run:
        raise typer.Exit(2)


def _definition_setup(settings: Settings) -> subscriber_ops.Setup:
    """What a definition is checked against, loaded as the relay loads it
    (relay.daemon.lifecycle): the writer schemas, the schema registry's check and the
    broker's partitions."""
    from relay import wiring

    schemas = subscriber_ops.load_schemas(settings)
    check = wiring.registry_check(wiring.registry_encoder(settings, schemas))
    return subscriber_ops.Setup(settings, schemas, check, wiring.partition_room)


def _definition_settings(
    ctx: typer.Context,
    database_url: str | None,
    schema: str | None,
    schemas_dir: Path | None,
    schema_registry_url: str | None,
    bootstrap_servers: str | None,
) -> Settings:
    """The settings a definition is checked with: the relay's, as `run` reads them."""
    return _settings(
        ctx,
        database_url=database_url,
        database_schema=schema,
        schemas_dir=schemas_dir,
        schema_registry_url=schema_registry_url,
        bootstrap_servers=bootstrap_servers,
    )


def _given(ctx: typer.Context) -> set[str]:
    """The fields of the options given on the command line (not left to their default;
    typer's click may be its own copy, so the source is told by name)."""
    sources = {k: ctx.get_parameter_source(k) for k in FIELDS}
    return {FIELDS[k] for k, source in sources.items() if source and source.name != "DEFAULT"}


def _indexing(parts: int) -> None:
    out.print(f"indexing its {parts} parts (waits for open transactions to end)")


def _print_outcome(outcome: subscriber_ops.Outcome, *, dry_run: bool = False) -> None:
    """The checks' findings, the change field by field, what a changed filter means for
    the events, and what was done."""
    report, change = outcome.report, outcome.change
    for line in [*report.checked, *report.unchecked]:
        out.print(line)
    for line in report.warnings:
        err.print(f"warning: {line}")
    name = change.after.name
    for difference in change.differences:
        out.print(f"  {difference}")
    if change.narrowed:
        waiting = (
            ""
            if outcome.dropped is None
            else (f"{events(outcome.dropped)} events waiting after its checkpoint, and ")
        )
        err.print(
            f"the filter narrows ({', '.join(change.narrowed)}): {waiting}every later event "
            f"of the kinds it no longer takes, will not be published by {name!r}"
        )
    if change.widened:
        err.print(
            f"the filter widens ({', '.join(change.widened)}): events of the kinds it adds "
            "are published from the checkpoint on; earlier ones are not"
        )
    if outcome.applied:
        out.print(f"{'added' if change.before is None else 'updated'} subscriber {name!r}")
    elif not change.changed:
        out.print(f"subscriber {name!r}: nothing to change")
    elif dry_run:
        out.print("dry run: nothing written")
    elif outcome.resets:
        reset = ", ".join(d.field for d in outcome.resets)
        err.print(
            f"not applied: --replace sets the options not given back to their defaults "
            f"({reset}); give them again, change only some options with `outbox-relay "
            f"subscribers set {name} --OPTION VALUE`, or repeat with --yes"
        )
    elif outcome.needs_yes:
        err.print("not applied: repeat with --yes to apply")


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
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(show_default=False)] = None,
    every: Annotated[
        bool, typer.Option("--all", help="Every paused or halted subscriber.")
    ] = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Resume a paused subscriber, or one halted by a poison event, from its checkpoint
    (a halted part retries its event)."""
    if (name is None) is not every:
        raise typer.BadParameter("name a subscriber, or give --all (not both)")
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        resumed = subscriber_ops.resume(store, None if every else [name or ""], actor())
    for r in resumed:
        why = ["was paused"] if r.paused and every else []
        why += [f"part {part} was halted: {error}" for part, error in r.halted.items()]
        out.print(f"subscriber {r.name!r} resumed" + (f" ({'; '.join(why)})" if why else ""))
    if every and not resumed:
        out.print("no subscriber is paused or halted")


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


@subscribers_app.command("replay")
def subscribers_replay(
    ctx: typer.Context,
    name: str,
    start: Annotated[
        str,
        typer.Option(
            "--from",
            help="TRANSACTION_ID:POSITION of the first event (included).",
            show_default=False,
        ),
    ],
    end: Annotated[
        str,
        typer.Option(
            "--to", help="TRANSACTION_ID:POSITION of the last event (included).", show_default=False
        ),
    ],
    into: Annotated[
        str | None,
        typer.Option(help="The topic to publish into [the subscriber's own topics]."),
    ] = None,
    aggregate_type: AggregateTypes = None,
    event_type: EventTypes = None,
    batch_size: BatchSize = 500,
    as_json: JsonFlag = False,
    dry_run: DryRun = False,
    yes: Yes = False,
    schemas_dir: SchemasDir = None,
    schema_registry_url: RegistryUrl = None,
    bootstrap_servers: Bootstrap = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Publish a range of a subscriber's events again, exactly once, as the relay
    encodes them, each record marked with the header outbox.replay (its ledger entry).
    Counts them first (--dry-run: only that). Interrupted, run it again with the same
    options: it goes on where it stopped, publishing nothing twice."""
    from contextlib import nullcontext

    from relay import wiring
    from relay.core.ports import Publisher
    from relay.core.replay import HEADER_REPLAY, ReplayRange
    from relay.ops import replay as replay_ops

    try:
        first, last = Position.parse(start), Position.parse(end)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--from/--to") from exc
    settings = _definition_settings(ctx, database_url, schema, schemas_dir, schema_registry_url,
                                    bootstrap_servers)  # fmt: skip

    def asked(subscriber: subs.Subscriber) -> ReplayRange:
        return ReplayRange.of(subscriber, first, last, into, aggregate_type, event_type)

    confirm = gate(dry_run=dry_run, yes=yes, machine_output=as_json)
    with _store(settings) as store:
        conn, schema = store.conn, settings.database_schema
        record = wiring.topic_record(lambda: nullcontext(conn), schema)

        def publisher(prefix: str, guard: subs.TopicGuard) -> Publisher:
            return wiring.exactly_once_publisher(settings, prefix, guard, record, "replay")

        ledger = wiring.replay_ledger(conn, schema)
        done = replay_ops.replay(
            settings, store, ledger, publisher, name, asked, actor(), confirm,
            wiring.registry_encoder, batch_size=batch_size,
        )  # fmt: skip
    if done is None:
        return
    if as_json:
        print_json(done.as_dict())
        return
    resumed = f", going on after {done.resumed_after}" if done.resumed_after else ""
    out.print(
        f"subscriber {name!r}: replay #{done.entry} done: {done.published} event(s) published "
        f"by this run{resumed} (header {HEADER_REPLAY}={done.entry})"
    )
    if done.pruned:
        err.print(
            Text(f"{done.pruned} event(s) of the range were pruned before the replay "
                 "published them: they are not on the topic", style="red")
        )  # fmt: skip
        raise typer.Exit(1)


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
