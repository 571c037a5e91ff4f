"""``verify``: the topics checked against the outbox."""

from __future__ import annotations

from collections.abc import Callable
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
from relay.core.settings import Settings
from relay.errors import ConfigError, RelayError

# verify's exit code when Postgres or Kafka could not be read (1 means findings), and
# when it found none but events the operator skipped (issue #48: never passed for clean).
_COULD_NOT_CHECK = 3
_SKIPPED_BY_OPERATOR = 4


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
    through: Annotated[
        str | None,
        typer.Option(
            metavar="SINK",
            help="Check a consumer's sink at PATH instead of the topics: archive (the "
            "Spark archive's Parquet folder), delta (its Delta Lake table) or projection "
            "(the order projection's database URL).",
        ),
    ] = None,
    path: Annotated[
        str | None,
        typer.Argument(
            metavar="PATH",
            help="The sink's location (with --through); default: $RELAY_SINK_URL, or the "
            "contents of the file $RELAY_SINK_URL_FILE names (keeps a password out of argv).",
        ),
    ] = None,
) -> None:
    """Check the topics against the outbox: missing, duplicated, out-of-order events.

    With --through SINK PATH, check a consumer's sink instead: every event the
    subscriber published to the topics the sink holds is there exactly once (missing,
    twice, not the outbox's); for a projection, each order's row is at its last
    published event (missing, quarantined, not the outbox's).

    Exits 0 when clean, 1 when it finds any, 2 on a configuration error, 3 when it
    could not check (Postgres or Kafka unreachable, a topic unreadable in time, the sink
    unreadable), and 4 when it finds none but events the operator skipped (listed with
    their actions).
    """
    from relay import wiring
    from relay.ops.verify import verify as run_verify

    if through is None and path is not None:
        raise typer.BadParameter("PATH needs --through", param_hint="--through SINK PATH")
    if through is not None and path is None:
        path = _sink_location()
    settings = _settings(
        ctx,
        database_url=database_url,
        bootstrap_servers=bootstrap_servers,
        database_schema=schema,
    )
    if through is not None and path is not None:
        _verify_sink(settings, through, path, subscriber, as_json)
        return
    reader = wiring.topic_reader(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()},
        timeout=timeout,
    )
    reports = _checked(lambda: _verify_all(settings, reader, subscriber, as_json, run_verify))
    _show(reports, as_json, _print_reports)
    if not all(r.clean for r in reports):
        raise typer.Exit(_SKIPPED_BY_OPERATOR)


def _checked(check: Callable[[], list[Any]]) -> list[Any]:
    """The reports of ``check``; exit 3 when it could not check (a configuration error
    left to the entry point: exit 2)."""
    try:
        return check()
    except ConfigError:
        raise
    except RelayError as exc:
        err.print(f"outbox-relay: could not check: {exc}")
        raise typer.Exit(_COULD_NOT_CHECK) from exc


def _show(reports: list[Any], as_json: bool, show: Callable[[list[Any]], None]) -> None:
    """The reports, as JSON or by ``show``; exit 1 when any has problems."""
    if as_json:
        print_json([r.as_dict() for r in reports])
    else:
        show(reports)
    if any(r.problems for r in reports):
        raise typer.Exit(1)


def _verify_all(
    settings: Settings,
    reader: Any,
    subscriber: list[str] | None,
    as_json: bool,
    run_verify: Any,
) -> list[Any]:
    from rich.markup import escape
    from rich.progress import Progress

    from relay import wiring

    with (
        wiring.connect(settings, "outbox-relay-verify") as conn,
        Progress(console=err, transient=True, disable=as_json) as progress,
    ):
        tasks: dict[str, Any] = {}

        def advance(name: str, done: int, total: int) -> None:
            if name not in tasks:
                # The progress bar reads its description as rich markup.
                described = f"reading {escape(name)}'s topics"
                tasks[name] = progress.add_task(described, total=total or None)
            progress.update(tasks[name], completed=done, total=total or None)

        schema = settings.database_schema
        reports: list[Any] = run_verify(
            wiring.store_on(conn, schema),
            wiring.verify_outbox(conn, schema),
            reader,
            subscribers=subscriber,
            progress=advance,
        )
    return reports


def _sink_location() -> str:
    """The sink's location from the environment, the relay's way with secrets."""
    from relay.core.settings import secret_from_environment

    location = secret_from_environment("sink_url")
    if not location:
        raise typer.BadParameter(
            "give PATH, RELAY_SINK_URL or RELAY_SINK_URL_FILE", param_hint="--through SINK PATH"
        )
    return location


def _verify_sink(
    settings: Settings, name: str, path: str, subscriber: list[str] | None, as_json: bool
) -> None:
    from relay import wiring
    from relay.core.ports import ProjectionReader
    from relay.ops.verify_projection import verify_projection
    from relay.ops.verify_sink import verify_sink

    sink = wiring.sink_reader(name, path)

    def check() -> list[Any]:
        with wiring.connect(settings, "outbox-relay-verify") as conn:
            schema = settings.database_schema
            store, outbox = wiring.store_on(conn, schema), wiring.verify_outbox(conn, schema)
            if isinstance(sink, ProjectionReader):
                return list(verify_projection(store, outbox, sink, name, subscribers=subscriber))
            return list(verify_sink(store, outbox, sink, name, subscribers=subscriber))

    printer = (
        _print_projection_reports if isinstance(sink, ProjectionReader) else _print_sink_reports
    )
    _show(_checked(check), as_json, printer)


def _print_counts(reports: list[Any], third: str, legend: str) -> None:
    """The sink reports' table, whose fourth count (``third``) is the sink kind's own."""
    table = Table(
        "subscriber", "sink", "expected", "found", "missing", third.replace("_", " "),
        "not in outbox", "ahead", "outside range", "verdict",
    )  # fmt: skip
    for r in reports:
        counts = (r.expected, r.found, r.missing, getattr(r, third), r.not_in_outbox, r.ahead)
        table.add_row(
            r.subscriber, r.sink, *(str(v) for v in (*counts, r.outside_range)), _verdict(r.verdict)
        )
    out.print(table)
    err.print(legend)


def _print_projection_reports(reports: list[Any]) -> None:
    _print_counts(
        reports,
        "quarantined",
        "expected and found count keys (orders): found, its row at its last event; missing: "
        "no row, or an older event's; quarantined: in the projection's error table; not in "
        "outbox: a row at no committed event; ahead: past the checkpoint; outside range: "
        "before the subscriber's start or outside its filters",
    )
    _print_examples(reports)


def _print_sink_reports(reports: list[Any]) -> None:
    _print_counts(
        reports,
        "twice",
        "twice: held more than once; not in outbox: no committed event has the id (rolled "
        "back, foreign, or pruned since); ahead: published past the checkpoint; outside "
        "range: before the subscriber's start or outside its filters",
    )
    for r in reports:
        err.print(f"{r.subscriber}: checked the topics {', '.join(r.topics) or '(none)'}")
        if r.topics_not_in_sink:
            err.print(f"{r.subscriber}: the sink holds none of {', '.join(r.topics_not_in_sink)}")
    _print_examples(reports)


def _print_examples(reports: list[Any]) -> None:
    for r in reports:
        for kind, examples in r.examples.items():
            for text in examples:
                err.print(f"{r.subscriber}: {kind}: {text}")


def _print_reports(reports: list[Any]) -> None:
    table = Table(
        "subscriber", "expected", "found", "missing", "duplicated", "out of order", "ahead",
        "before start", "not in outbox", "skipped by operator", "dead-lettered", "pending",
        "verdict",
    )  # fmt: skip
    for r in reports:
        table.add_row(
            r.subscriber,
            *(str(v) for v in (r.expected, r.found, r.missing, r.duplicated, r.out_of_order)),
            *(str(v) for v in (r.ahead, r.before_start, r.not_in_outbox, r.skipped_by_operator)),
            str(r.dead_lettered),
            f"~{r.pending}" if r.pending_estimated else str(r.pending),
            _verdict(r.verdict),
        )
    out.print(table)
    err.print(
        "ahead: published just before a crash, adopted by the next owner; before start: "
        "published before a reset; not in outbox: rows pruned since; skipped by operator: "
        "events every reset forward jumped over and every `subscribers skip` skipped, "
        "never published (each below with its ledger entry)"
    )
    for r in reports:
        for skip in r.skips:
            err.print(f"{r.subscriber}: {skip.describe()}")
        for replay in r.replays:
            err.print(f"{r.subscriber}: {replay.describe()}")
        if r.checked_after:
            err.print(
                f"{r.subscriber}: checked only events after {', '.join(r.checked_after)}, "
                "where the subscriber was created or last reset (subscribers reset)"
            )
        for kind, examples in r.examples.items():
            for text in examples:
                err.print(f"{r.subscriber}: {kind}: {text}")


def _verdict(verdict: str) -> Text:
    styles = {"clean": "green", "skipped by operator": "yellow", "problems": "red"}
    return Text(verdict.upper() if verdict == "problems" else verdict, style=styles[verdict])
