"""The ``outbox-relay`` command line."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Optional

import psycopg
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from relay import db, logs, migrations
from relay import subscribers as subs
from relay.errors import ConfigError, DatabaseUnavailable, RelayError, SchemaRegistryUnavailable
from relay.key_space import KeySpaceAction, report
from relay.lag import EXACT_UP_TO, SubscriberStatus, subscriber_statuses
from relay.model import Position
from relay.redact import redact
from relay.routing import DEFAULT_KEY
from relay.settings import Settings, load_settings
from relay.store import OutboxStore

logger = logging.getLogger(__name__)

app = typer.Typer(
    name="outbox-relay",
    help="Publish committed Postgres outbox events to Kafka, in order, per subscriber.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
subscribers_app = typer.Typer(
    help="Create, inspect, pause and rewind subscribers.", no_args_is_help=True
)
app.add_typer(subscribers_app, name="subscribers")

# Everything printed comes from data that writers, operators and other database clients
# control (event types, aggregate types, halt errors, application names): none of it is
# parsed as rich markup or emoji codes. Styling is given explicitly, with rich Text.
# verify's exit code when Postgres or Kafka could not be read (1 means findings).
_COULD_NOT_CHECK = 3


# Piped or redirected output is not cut to 80 columns (rich's default off a terminal).
def _width(stream: Any) -> int | None:
    if stream.isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else 250


out = Console(markup=False, emoji=False, highlight=False, width=_width(sys.stdout))
err = Console(stderr=True, markup=False, emoji=False, highlight=False, width=_width(sys.stderr))

# Options shared by several commands. Flags win over RELAY_* variables and the file.
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="libpq URL [RELAY_DATABASE_URL]")
]
Schema = Annotated[
    str | None, typer.Option("--schema", help="Postgres schema [RELAY_DATABASE_SCHEMA]")
]
Bootstrap = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--bootstrap-servers", help="Kafka HOST:PORT[,...] [RELAY_BOOTSTRAP_SERVERS]"),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


@dataclass
class Globals:
    config: Path | None


@app.callback()
def _globals(
    ctx: typer.Context,
    config: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--config", "-c", envvar="RELAY_CONFIG", help="TOML settings file [RELAY_CONFIG]."
        ),
    ] = None,
) -> None:
    ctx.obj = Globals(config)


def _settings(ctx: typer.Context, **flags: Any) -> Settings:
    settings = load_settings(ctx.obj.config, **flags)
    logs.configure(settings.log_level, settings.log_format)
    return settings


@contextmanager
def _store(settings: Settings) -> Iterator[OutboxStore]:
    with db.connect(settings.require_database_url(), application_name="outbox-relay-cli") as conn:
        yield OutboxStore(conn, settings.database_schema)


def _connect_waiting(settings: Settings, application_name: str) -> psycopg.Connection[Any]:
    """A connection, waiting for a Postgres that is down or starting as `run` waits for
    it (backoff up to 30 s, until Ctrl-C or SIGTERM); a permanent refusal (unknown
    database, bad credentials, missing grants) fails at once."""
    delay = 0.5
    while True:
        try:
            return db.connect(settings.require_database_url(), application_name=application_name)
        except DatabaseUnavailable as exc:
            logger.warning("waiting for Postgres: %s; retrying in %.0fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


@app.command()
def migrate(ctx: typer.Context, database_url: DatabaseUrl = None, schema: Schema = None) -> None:
    """Create or upgrade the outbox tables (idempotent, safe to run concurrently)."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _connect_waiting(settings, "outbox-relay-migrate") as conn:
        applied = migrations.migrate(conn, settings.database_schema)
        store = OutboxStore(conn, settings.database_schema)
        # A restore procedure migrates before writers start: the best moment to rebase.
        moved = store.check_key_space()
        store.index_parts()  # the owner's run: a relay's role may not build them
    if moved is not None and moved.action is not KeySpaceAction.UNCHANGED:
        report(moved, "migrate")
        out.print(f"key space {moved.action}: {moved.detail}", markup=False)
    names = [f"{m.version:04d}_{m.name}" for m in applied]
    out.print(f"applied {names}" if names else f"schema {settings.database_schema!r} is up to date")


@app.command()
def run(
    ctx: typer.Context,
    database_url: DatabaseUrl = None,
    bootstrap_servers: Bootstrap = None,
    schema: Schema = None,
    schemas_dir: Annotated[
        Path | None, typer.Option(help="Avro schemas folder [RELAY_SCHEMAS_DIR]")
    ] = None,
    migrate_first: Annotated[
        bool, typer.Option("--migrate", help="Apply migrations before starting.")
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(help="Member processes, to publish on several cores [RELAY_WORKERS]."),
    ] = None,
    tracing: Annotated[
        bool | None,
        typer.Option(
            "--tracing/--no-tracing",
            help="OpenTelemetry spans per published event (the 'tracing' extra) [RELAY_TRACING]",
        ),
    ] = None,
    tracing_endpoint: Annotated[
        str | None,
        typer.Option(help="OTLP/HTTP traces endpoint [RELAY_TRACING_ENDPOINT]"),
    ] = None,
) -> None:
    """Run the relay until SIGTERM or Ctrl-C."""
    from relay.daemon import Relay, RelayProcesses, start_with_retries, tune_gc

    settings = _settings(
        ctx,
        database_url=database_url,
        bootstrap_servers=bootstrap_servers,
        database_schema=schema,
        schemas_dir=schemas_dir,
        workers=workers,
        tracing=tracing,
        tracing_endpoint=tracing_endpoint,
    )
    if migrate_first:
        with _connect_waiting(settings, "outbox-relay-migrate") as conn:
            migrations.migrate(conn, settings.database_schema)
    relay = Relay(settings) if settings.workers == 1 else RelayProcesses(settings)
    tune_gc()
    _allow_open_files()
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck part waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The handler only raises a flag; this thread does the stopping, never mid-start.
    with _stop_on_signals(relay.request_stop):
        start_with_retries(relay)
        relay.wait()
        relay.stop()


def _allow_open_files() -> None:
    """Raise the soft limit on open files to the hard one (inherited by worker processes).

    Each part holds a Postgres connection and a producer's sockets, so 100 parts need
    over a thousand descriptors, and container runtimes commonly set a soft limit of
    1024 (with a far higher hard one): the relay would fail to connect part after part.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-files limit from %s to %s: %s", soft, wanted, exc)


@app.command()
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


@app.command()
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
) -> None:
    """Local Postgres and Apache Kafka for your own app: the demo's stack, no demo writer."""
    from relay.localstack.stack import run_local

    logs.configure("INFO")
    run_local(
        workdir=workdir, database=database, postgres_port=postgres_port, kafka_port=kafka_port
    )


@app.command()
def verify(
    ctx: typer.Context,
    subscriber: Annotated[
        list[str] | None, typer.Option(help="Only these subscribers (repeatable).")
    ] = None,
    as_json: JsonFlag = False,
    timeout: Annotated[
        float, typer.Option(min=1, help="Give up reading a topic after this many seconds.")
    ] = 600.0,
    database_url: DatabaseUrl = None,
    bootstrap_servers: Bootstrap = None,
    schema: Schema = None,
) -> None:
    """Check the topics against the outbox: missing, duplicated, out-of-order events.

    Exits 0 when clean, 1 when it finds any, 2 on a configuration error, and 3 when it
    could not check (Postgres or Kafka unreachable, a topic unreadable in time).
    """
    from relay.topic_reader import KafkaTopicReader
    from relay.verify import verify as run_verify

    settings = _settings(
        ctx,
        database_url=database_url,
        bootstrap_servers=bootstrap_servers,
        database_schema=schema,
    )
    reader = KafkaTopicReader(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()},
        timeout=timeout,
    )
    try:
        reports = _verify_all(settings, reader, subscriber, as_json, run_verify)
    except ConfigError:
        raise
    except RelayError as exc:
        err.print(f"outbox-relay: could not check: {exc}")
        raise typer.Exit(_COULD_NOT_CHECK) from exc
    if as_json:
        sys.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")
    else:
        _print_reports(reports)
    if not all(r.clean for r in reports):
        raise typer.Exit(1)


def _verify_all(
    settings: Settings,
    reader: Any,
    subscriber: list[str] | None,
    as_json: bool,
    run_verify: Any,
) -> list[Any]:
    from rich.progress import Progress

    with (
        db.connect(settings.require_database_url(), application_name="outbox-relay-verify") as conn,
        Progress(console=err, transient=True, disable=as_json) as progress,
    ):
        tasks: dict[str, Any] = {}

        def advance(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(f"reading {name}'s topics", total=total or None)
            progress.update(tasks[name], completed=done, total=total or None)

        reports: list[Any] = run_verify(
            conn, settings.database_schema, reader, subscribers=subscriber, progress=advance
        )
    return reports


def _print_reports(reports: list[Any]) -> None:
    table = Table(
        "subscriber", "expected", "found", "missing", "duplicated", "out of order", "ahead",
        "before start", "not in outbox", "skipped by reset", "dead-lettered", "pending",
        "verdict",
    )  # fmt: skip
    for r in reports:
        table.add_row(
            r.subscriber,
            *(str(v) for v in (r.expected, r.found, r.missing, r.duplicated, r.out_of_order)),
            *(str(v) for v in (r.ahead, r.before_start, r.not_in_outbox, r.skipped_by_reset)),
            str(r.dead_lettered),
            f"~{r.pending}" if r.pending_estimated else str(r.pending),
            Text("clean", style="green") if r.clean else Text("PROBLEMS", style="red"),
        )
    out.print(table)
    err.print(
        "ahead: published just before a crash, adopted by the next owner; before start: "
        "published before a reset; not in outbox: rows pruned since; skipped by reset: "
        "events a reset forward jumped over, never published"
    )
    for r in reports:
        if r.checked_after:
            err.print(
                f"{r.subscriber}: checked only events after {', '.join(r.checked_after)}, "
                "where the subscriber was created or last reset (subscribers reset)"
            )
        for kind, examples in r.examples.items():
            for text in examples:
                err.print(f"{r.subscriber}: {kind}: {text}")


@app.command()
def status(
    ctx: typer.Context,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Subscribers and their parts (checkpoint, lag, owner), relay sessions, and the
    transactions holding publication back."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        report = _status(store)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
        return
    if not report["parts"] and not report["sessions"]:
        out.print(
            "No subscriber and no relay yet: `outbox-relay run` creates the default "
            "subscriber and publishes; `outbox-relay subscribers add` declares others."
        )
    else:
        _print_parts_and_sessions(report)
    _print_horizon(report)


def _print_parts_and_sessions(report: dict[str, Any]) -> None:
    parts = Table(
        "part", "checkpoint", "lag (events)", "lag (s)", "skipped by reset", "owner", "state"
    )
    for p in report["parts"]:
        parts.add_row(
            p["part"], p["checkpoint"], _events(p), f"{p['lag_seconds']:.1f}", _skipped(p),
            p["owner"] or "-", _part_state(p),
        )  # fmt: skip
    out.print(parts)
    _print_estimate_note(report["parts"])
    _print_halts(report["parts"])
    _print_skips(report["parts"])
    sessions = Table("session", "host", "pid", "heartbeat (s ago)", "parts")
    for s in report["sessions"]:
        sessions.add_row(
            str(s["id"]), s["hostname"], str(s["pid"]), f"{s['heartbeat_age_s']:.1f}",
            str(s["parts"]),
        )  # fmt: skip
    out.print(sessions)


def _print_horizon(report: dict[str, Any]) -> None:
    if not report["horizon_holders_complete"]:
        err.print(
            Text("the details of other roles' sessions are hidden from this role (it lacks "
                 "pg_read_all_stats): a transaction holding publication back shows "
                 "without its age, state and query start; run status as the owner, or see "
                 "`outbox-relay grant --read-all-stats`", style="yellow")
        )  # fmt: skip
    if report["horizon_holders"]:
        holders = Table("pid", "xid", "age (s)", "state", "application", "query start")
        for h in report["horizon_holders"]:
            if h["gid"] is not None:  # no session: name it for ROLLBACK/COMMIT PREPARED
                holders.add_row(
                    "-", h["xid"], f"{h['age_s']:.1f}", "prepared",
                    f"gid {h['gid']!r}, owner {h['owner']}, database {h['database']}", "-",
                )  # fmt: skip
                continue
            holders.add_row(
                str(h["pid"]), h["xid"], _hidden_or(h["age_s"], "{:.1f}"), _hidden_or(h["state"]),
                _hidden_or(h["application_name"]), _hidden_or(h["query_start"]),
            )  # fmt: skip
        out.print(Text("open transactions holding publication back", style="bold"))
        out.print(holders)


def _events(row: dict[str, Any]) -> str:
    """A lag in events as printed: ``~`` marks an estimate."""
    return f"~{row['lag_events']}" if row["lag_estimated"] else str(row["lag_events"])


def _print_estimate_note(rows: list[dict[str, Any]]) -> None:
    if any(r["lag_estimated"] for r in rows):
        out.print(
            f"~: an estimate (past {EXACT_UP_TO} events behind, a part's lag is estimated "
            "from the outbox's positions, not counted)"
        )


def _skipped(row: dict[str, Any]) -> str:
    """Events a reset forward jumped over, as printed: ``+`` marks a lower bound."""
    return f"{row['skipped_by_reset']}{'+' if row['skipped_at_least'] else ''}"


def _print_skips(rows: list[dict[str, Any]]) -> None:
    """A reset that skipped events, or a checkpoint no row can reach, must not pass for
    a caught-up subscriber (issue #28)."""
    for r in rows:
        if r["beyond_horizon"]:
            out.print(
                Text(f"{r['part']}: its checkpoint {r['checkpoint']} is beyond what the "
                     "database has decided: every event written now sorts before it and is "
                     "NEVER published (counted as skipped by reset); reset it to 'now' or "
                     "to a point below the horizon", style="bold red")
            )  # fmt: skip
    if any(r["skipped_by_reset"] for r in rows):
        out.print(
            f"skipped by reset: events the last `subscribers reset` forward jumped over "
            f"(+: counted over the first {EXACT_UP_TO} rows only); they are not published"
        )


def _hidden_or(value: Any, fmt: str = "{}") -> str:
    """A pg_stat_activity detail, or 'hidden' where this role may not see it."""
    return "hidden" if value is None else fmt.format(value)


def _part_state(part: dict[str, Any]) -> Text:
    if part["beyond_horizon"]:
        return Text("BEYOND HORIZON", style="bold red")
    if part["halted"] is not None:
        return Text("HALTED", style="bold red")
    return Text("paused", style="yellow") if part["paused"] else Text("active")


def _print_halts(parts: list[dict[str, Any]]) -> None:
    """Halted parts publish nothing until resumed: say so where it cannot be missed."""
    halted = [p for p in parts if p["halted"] is not None]
    if not halted:
        return
    out.print(
        Text(f"{len(halted)} halted part(s): nothing is published for them until "
             "`outbox-relay subscribers resume NAME`", style="bold red")
    )  # fmt: skip
    for p in halted:
        out.print(Text.assemble((f"  {p['part']}: ", "red"), p["halted"]))


def _status(store: OutboxStore) -> dict[str, Any]:
    sessions = store.list_sessions()
    names = {s["id"]: f"{s['hostname']}:{s['pid']}" for s in sessions}
    parts = []
    for subscriber in subscriber_statuses(store):
        for p in subscriber.parts:
            parts.append(
                {
                    "part": f"{p.state.name}/{p.state.part}",
                    "checkpoint": str(p.state.checkpoint),
                    "lag_events": p.lag.events,
                    "lag_estimated": p.lag.estimated,
                    "lag_seconds": p.lag.seconds,
                    "skipped_by_reset": p.skipped.events,
                    "skipped_at_least": p.skipped.at_least,
                    "beyond_horizon": p.skipped.beyond_horizon,
                    "owner": names.get(p.state.owner) if p.state.owner else None,
                    "paused": subscriber.state.subscriber.paused,
                    "halted": p.state.halted_error,
                }
            )
    return {
        "parts": parts,
        "sessions": sessions,
        "horizon_holders": [vars(h) for h in store.horizon_holders()],
        # False: other roles' sessions are hidden from this role (no pg_read_all_stats).
        "horizon_holders_complete": store.sees_all_backends(),
    }


@app.command()
def grant(
    ctx: typer.Context,
    relay_role: Annotated[
        str | None,
        typer.Option(
            help="Role the relay runs as: gets only what it needs (it prunes through "
            "outbox_prune(), with no DELETE on the outbox)."
        ),
    ] = None,
    writer_role: Annotated[
        str | None,
        typer.Option(
            help="Role applications write events as: INSERT and SELECT on the columns the "
            "write API reads back (never payloads), SELECT on outbox_position_seq."
        ),
    ] = None,
    create: Annotated[
        bool, typer.Option(help="Create the roles (LOGIN, no password) if missing.")
    ] = False,
    read_all_stats: Annotated[
        bool,
        typer.Option(
            help="Also grant the relay role pg_read_all_stats, so it can name the sessions "
            "holding publication back (it then sees every session's query text too). "
            "Without it, the role is left without pg_read_all_stats."
        ),
    ] = False,
    connection_limit: Annotated[
        int | None,
        typer.Option(
            min=-1,
            help="Cap the relay role's Postgres connections (CONNECTION LIMIT; -1: no cap). "
            "Relays need replicas x workers x max_db_connections (deploy/README.md).",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Grant least privileges to the relay's and the writers' roles (run as the owner)."""
    from relay.roles import grant_roles

    if relay_role is None and writer_role is None:
        raise typer.BadParameter("name --relay-role and/or --writer-role")
    if connection_limit is not None and relay_role is None:
        raise typer.BadParameter("--connection-limit caps the --relay-role: name it")
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with db.connect(settings.require_database_url(), application_name="outbox-relay-cli") as conn:
        done = grant_roles(
            conn,
            settings.database_schema,
            relay_role=relay_role,
            writer_role=writer_role,
            create=create,
            read_all_stats=read_all_stats,
            connection_limit=connection_limit,
        )
    out.print("granted: " + ", ".join(done))


@app.command()
def prune(
    ctx: typer.Context,
    older_than: Annotated[
        float, typer.Option(min=0, help="Keep published rows younger than this (seconds).")
    ] = 86_400.0,
    batch: Annotated[int, typer.Option(min=1, help="Rows deleted per transaction.")] = 10_000,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Delete outbox rows every subscriber has published (never an unpublished one)."""
    from rich.progress import Progress

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    total = 0
    with _store(settings) as store, Progress(console=err, transient=True) as progress:
        task = progress.add_task("pruning published rows", total=None)
        for deleted in store.prune(older_than, batch):
            total += deleted
            progress.update(task, completed=total)
    out.print(f"pruned {total} published rows")


debezium_app = typer.Typer(help="Debezium Outbox Event Router compatibility.")
app.add_typer(debezium_app, name="debezium")


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
    from relay.debezium import attach, parse_options

    options = parse_options(option or [])
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with db.connect(settings.require_database_url(), application_name="outbox-relay-cli") as conn:
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
    from relay.debezium import detach

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with db.connect(settings.require_database_url(), application_name="outbox-relay-cli") as conn:
        detach(conn, settings.database_schema, table)
    out.print(f"inserts into {table} no longer reach the relay's outbox")


# -- subscribers ---------------------------------------------------------------------


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
        typer.Option(help="A field whose number is the record's partition [by key]."),
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
            "placements": placement or (),
            "key_format": key_format,
        }
    )
    if subscriber.value_format is subs.ValueFormat.AVRO_REGISTRY:
        _check_registry(settings, subscriber)
    with _store(settings) as store:
        created = store.add(subscriber, start, replace=replace)
        if parts > 1:
            out.print(f"indexing its {parts} parts (waits for open transactions to end)")
            store.index_parts()
    out.print(f"{'added' if created else 'updated'} subscriber {name!r}")


def _check_registry(settings: Settings, subscriber: subs.Subscriber) -> None:
    """Refuse (exit 2) a subscriber whose schemas the registry's compatibility rules
    refuse, naming the subject, its versions and the registry's reason; print what
    was checked and what only the first publish can check. A registry that cannot
    answer is a warning."""
    from relay.daemon.startup import load_schemas
    from relay.registry_compat import check_subscriber
    from relay.registry_format import encoder_for

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
        rows = [_listed(status) for status in subscriber_statuses(store)]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(
        "name", "topic", "format", "filter", "state", "parts", "checkpoint", "lag (events)",
        "skipped by reset",
    )  # fmt: skip
    for r in rows:
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
            _events(r),
            _skipped(r),
        )
    out.print(table)
    _print_estimate_note(rows)
    _print_skips([{**r, "part": r["name"]} for r in rows])
    for r in rows:
        for p in r["parts"]:
            if p["halted"]:
                err.print(
                    Text.assemble((f"{r['name']}/{p['part']} halted:", "red"), " ", p["halted"])
                )


def _listed(status: SubscriberStatus) -> dict[str, Any]:
    """A subscriber as ``subscribers list`` shows it."""
    definition = status.state.subscriber.as_dict()
    return {
        "name": definition["name"],
        "topic": definition["topic"],
        "format": definition["value_format"],
        "subject_strategy": definition["subject_strategy"],
        "key": definition["key"],
        "partition_by": definition["partition_by"],
        "placements": definition["placements"],
        "key_format": definition["key_format"],
        "aggregate_types": definition["aggregate_types"] or None,
        "event_types": definition["event_types"] or None,
        "paused": definition["paused"],
        "on_poison": definition["on_poison"],
        "checkpoint": str(status.state.checkpoint),
        "lag_events": status.lag.events,
        "lag_estimated": status.lag.estimated,
        "skipped_by_reset": status.skipped.events,
        "skipped_at_least": status.skipped.at_least,
        "beyond_horizon": status.skipped.beyond_horizon,
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
    database_url: DatabaseUrl = None,
    schema: Schema = None,
) -> None:
    """Move a subscriber's checkpoint (republishes or skips events!)."""
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
        store.reset(name, target)
    out.print(f"subscriber {name!r} reset to {to}")


@subscribers_app.command("remove")
def subscribers_remove(
    ctx: typer.Context, name: str, database_url: DatabaseUrl = None, schema: Schema = None
) -> None:
    """Delete a subscriber and its checkpoint."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        store.remove(name)
    out.print(f"removed subscriber {name!r}")


def _set_paused(
    ctx: typer.Context, name: str, paused: bool, database_url: str | None, schema: str | None
) -> None:
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _store(settings) as store:
        store.set_paused(name, paused)
    out.print(f"subscriber {name!r} {'paused' if paused else 'resumed'}")


# -- dead letters --------------------------------------------------------------------

dead_letters_app = typer.Typer(
    help="List a subscriber's dead letters; publish them once their cause is fixed.",
    no_args_is_help=True,
)
app.add_typer(dead_letters_app, name="dead-letters")


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
    from relay.redrive import DeadLetterStore

    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with db.connect(settings.require_database_url(), application_name="outbox-relay-cli") as conn:
        letters = DeadLetterStore(conn, settings.database_schema).dead_letters(
            subscriber, include_redriven=include_redriven
        )
    if as_json:
        sys.stdout.write(json.dumps([d.as_dict() for d in letters], indent=2) + "\n")
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
    batch_size: Annotated[
        int, typer.Option(min=1, max=10_000, help="Events per Kafka transaction.")
    ] = 500,
    as_json: JsonFlag = False,
    database_url: DatabaseUrl = None,
    bootstrap_servers: Bootstrap = None,
    schema: Schema = None,
) -> None:
    """Publish a subscriber's dead-lettered events, exactly once and in order per key,
    as the relay would publish them now (after a fix: a schema added, say). The live
    checkpoint does not move. Exits 1 when some stay dead-lettered (still poison, or
    behind a still-poison event of their key)."""
    import re
    from contextlib import closing

    from relay.daemon.startup import load_schemas, registry_encoder
    from relay.encoding import RecordEncoder
    from relay.redrive import DeadLetterStore, Redrive, redrive_publisher
    from relay.subscribers import TopicGuard

    settings = _settings(
        ctx,
        database_url=database_url,
        bootstrap_servers=bootstrap_servers,
        database_schema=schema,
        schemas_dir=schemas_dir,
    )
    registry = load_schemas(settings)
    allow = None if settings.topic_allow is None else re.compile(settings.topic_allow)
    guard = TopicGuard(settings.checkpoint_topic, allow)
    with db.connect(
        settings.require_database_url(), application_name="outbox-relay-redrive"
    ) as conn:
        store = DeadLetterStore(conn, settings.database_schema)
        state = store.subscriber(subscriber)
        guard.update(s.subscriber for s in store.outbox.list())
        with closing(redrive_publisher(settings, state.subscriber_id, guard)) as publisher:
            redrive = Redrive(
                store,
                publisher,
                RecordEncoder(registry, guard, registry_encoder(settings, registry)),
                state,
                batch_size=batch_size,
            )
            report = redrive.run()
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        _print_redrive(report)
    if report.left:
        raise typer.Exit(1)


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


# -- topics --------------------------------------------------------------------------

topics_app = typer.Typer(
    help="List and create Kafka topics with the relay's Kafka settings (no Kafka CLI needed).",
    no_args_is_help=True,
)
app.add_typer(topics_app, name="topics")


def _admin(ctx: typer.Context, bootstrap_servers: str | None) -> tuple[Any, Settings]:
    from relay.topics import admin_client

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
    from relay.topics import list_topics

    admin, _ = _admin(ctx, bootstrap_servers)
    topics = list_topics(admin, internal=internal)
    if as_json:
        sys.stdout.write(json.dumps([t.as_dict() for t in topics], indent=2) + "\n")
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
    from relay.topics import create_topics, parse_config

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


@contextmanager
def _stop_on_signals(stop: Any) -> Iterator[None]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main() -> None:
    """Console-script entry point: clear errors, meaningful exit codes."""
    try:
        app(prog_name="outbox-relay")
    # Redacted once more here: whatever path a URL took into a message, it is masked.
    except ConfigError as exc:
        sys.stderr.write(f"outbox-relay: configuration error: {redact(str(exc))}\n")
        sys.exit(2)
    except RelayError as exc:
        sys.stderr.write(f"outbox-relay: {redact(str(exc))}\n")
        sys.exit(1)
    except psycopg.Error as exc:  # should have been wrapped; never show a traceback for it
        sys.stderr.write(f"outbox-relay: database error: {redact(str(exc))}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
