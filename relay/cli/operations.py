"""Running and operating the relay: ``migrate``, ``run``, ``grant``, ``prune``."""

from __future__ import annotations

import faulthandler
import logging
import resource
import signal
from pathlib import Path
from typing import Annotated

import typer

from relay.adapters.postgres import db, migrations
from relay.adapters.postgres.store import OutboxStore
from relay.cli.common import (
    AllowPublicCreate,
    Bootstrap,
    DatabaseUrl,
    Schema,
    _connect_waiting,
    _settings,
    _stop_on_signals,
    _store,
    err,
    out,
)
from relay.core.key_space import KeySpaceAction, report
from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)


def migrate(
    ctx: typer.Context,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
    allow_public_create: AllowPublicCreate = False,
    lock_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to wait for the migration lock (another migrate holds it, or any "
            "other session: the error names it).",
        ),
    ] = migrations.LOCK_WAIT_S,
) -> None:
    """Create or upgrade the outbox tables (idempotent, safe to run concurrently)."""
    settings = _settings(ctx, database_url=database_url, database_schema=schema)
    with _connect_waiting(settings, "outbox-relay-migrate") as conn:
        applied = migrations.migrate(
            conn,
            settings.database_schema,
            allow_public_create=allow_public_create,
            lock_wait_s=lock_timeout,
        )
        store = OutboxStore(conn, settings.database_schema)
        # A restore procedure migrates before writers start: the best moment to rebase.
        moved = store.check_key_space()
        store.index_parts()  # the owner's run: a relay's role may not build them
    if moved is not None and moved.action is not KeySpaceAction.UNCHANGED:
        report(moved, "migrate")
        out.print(f"key space {moved.action}: {moved.detail}", markup=False)
    names = [f"{m.version:04d}_{m.name}" for m in applied]
    out.print(f"applied {names}" if names else f"schema {settings.database_schema!r} is up to date")


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
            help="OpenTelemetry spans per published batch, or per event (tracing_spans; the "
            "'tracing' extra) [RELAY_TRACING]",
        ),
    ] = None,
    tracing_endpoint: Annotated[
        str | None,
        typer.Option(help="OTLP/HTTP traces endpoint [RELAY_TRACING_ENDPOINT]"),
    ] = None,
) -> None:
    """Run the relay until SIGTERM or Ctrl-C."""
    from relay.daemon import Relay, RelayProcesses, start_with_retries, tune_process

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
    tune_process()
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
            logger.warning(
                "cannot raise the open-files limit from %s to %s: %s",
                soft,
                wanted,
                exc,
                extra=log_extra("open_files_limit_kept", soft=soft, wanted=wanted, error=exc),
            )


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
    aggregate_types: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated aggregate types the --writer-role may insert, and no "
            "other (row-level security on the outbox): a writer cannot write another's "
            "streams or topics. '*': any type again. Without it, what an earlier grant "
            "set stays.",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    schema: Schema = None,
    allow_public_create: AllowPublicCreate = False,
) -> None:
    """Grant least privileges to the relay's and the writers' roles (run as the owner)."""
    from relay.ops.roles import grant_roles

    if relay_role is None and writer_role is None:
        raise typer.BadParameter("name --relay-role and/or --writer-role")
    if connection_limit is not None and relay_role is None:
        raise typer.BadParameter("--connection-limit caps the --relay-role: name it")
    types = _aggregate_types(aggregate_types)
    if types is not None and writer_role is None:
        raise typer.BadParameter("--aggregate-types restricts the --writer-role: name it")
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
            aggregate_types=types,
            allow_public_create=allow_public_create,
        )
    out.print("granted: " + ", ".join(done))


def _aggregate_types(given: str | None) -> list[str] | None:
    if given is None:
        return None
    types = [t.strip() for t in given.split(",")]
    if not all(types):
        raise typer.BadParameter(
            f"--aggregate-types {given!r} has an empty type: name them, comma-separated"
        )
    if "*" in types and len(types) > 1:
        raise typer.BadParameter("--aggregate-types '*' (any type) stands alone")
    return types


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
