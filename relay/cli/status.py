"""``status``: subscribers' parts, relay sessions, and what holds publication back.

The command reads a typed :class:`StatusReport`; ``--json`` prints its
:meth:`StatusReport.as_dict`, the table view renders the same fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import typer
from rich.table import Table
from rich.text import Text

from relay.cli.backlog import SkipLine, events, print_estimate_note, print_skips, skipped
from relay.cli.common import (
    DatabaseUrl,
    JsonFlag,
    Schema,
    _settings,
    _store,
    err,
    out,
    print_json,
)
from relay.cli.interventions import print_operator_skips
from relay.core.interventions import OperatorSkip
from relay.core.model import PartId
from relay.core.ports import HorizonHolder, PartWait
from relay.ops.interventions import operator_skips
from relay.ops.lag import Lag, Skipped, subscriber_statuses

if TYPE_CHECKING:  # relay.wiring is imported when the command runs: it loads the Kafka client
    from relay.wiring import Store


@dataclass(frozen=True)
class PartLine:
    """One subscriber part as ``status`` shows it."""

    part: str  # subscriber/part
    checkpoint: str
    lag: Lag
    skipped: Skipped
    owner: str | None  # the owning relay session, as host:pid
    paused: bool
    halted: str | None  # the error that halted the part
    # What it waits for and since when, as its relay recorded it (issue #48); None: no
    # wait (or a schema before migration 0020).
    waiting: PartWait | None = None

    def as_dict(self) -> dict[str, Any]:
        wait = self.waiting
        return {
            "part": self.part,
            "checkpoint": self.checkpoint,
            "lag_events": self.lag.events,
            "lag_estimated": self.lag.estimated,
            "lag_seconds": self.lag.seconds,
            "skipped_by_operator": self.skipped.events,
            "skipped_by_reset": self.skipped.by_reset,
            "skipped_by_skip": self.skipped.by_skip,
            "skipped_at_least": self.skipped.at_least,
            "beyond_horizon": self.skipped.beyond_horizon,
            "owner": self.owner,
            "paused": self.paused,
            "halted": self.halted,
            "waiting_on": None if wait is None else wait.waits_on,
            "waiting_error": None if wait is None else wait.error,
            "waiting_since": None if wait is None else wait.since.isoformat(),
        }


@dataclass(frozen=True)
class Session:
    """A relay session (one relay process), from the store's session listing."""

    id: UUID
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_age_s: float
    expired: bool
    parts: int  # parts it owns

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Session:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class TopicBudget:
    """The topics rows made (they count against max_created_topics), and the cap as
    this command's settings have it (-1: none)."""

    used: int
    cap: int

    @property
    def full(self) -> bool:
        return 0 <= self.cap <= self.used


@dataclass(frozen=True)
class StatusReport:
    parts: list[PartLine]
    # What the operator skipped, per subscriber, with the ledger entries (issue #48).
    skips: dict[str, list[OperatorSkip]]
    sessions: list[Session]
    horizon_holders: list[HorizonHolder]
    # False: other roles' sessions are hidden from this role (no pg_read_all_stats).
    horizon_holders_complete: bool
    topic_budget: TopicBudget | None = None  # None: a schema before migration 0017

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` output."""
        budget = self.topic_budget
        return {
            "parts": [p.as_dict() for p in self.parts],
            "skips": {name: [k.as_dict() for k in found] for name, found in self.skips.items()},
            "sessions": [asdict(s) for s in self.sessions],
            "horizon_holders": [vars(h) for h in self.horizon_holders],
            "horizon_holders_complete": self.horizon_holders_complete,
            "topics_created_for_rows": None if budget is None else budget.used,
            "max_created_topics": None if budget is None else budget.cap,
            "topic_budget_full": budget is not None and budget.full,
        }


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
        report = _status(store, settings.max_created_topics)
    if as_json:
        print_json(report.as_dict())
        return
    if not report.parts and not report.sessions:
        out.print(
            "No subscriber and no relay yet: `outbox-relay run` creates the default "
            "subscriber and publishes; `outbox-relay subscribers add` declares others."
        )
    else:
        _print_parts_and_sessions(report)
    _print_topic_budget(report.topic_budget)
    _print_horizon(report)


def _print_topic_budget(budget: TopicBudget | None) -> None:
    """A full budget stalls the parts whose rows name a new topic: say so, and the fix."""
    if budget is None or not budget.full:
        return
    out.print(
        Text(f"topics created for rows: {budget.used} of max_created_topics ({budget.cap}), "
             "full: a part whose rows name a new topic waits (outbox_relay_part_waiting, "
             "service topic_budget). Raise max_created_topics, or confine the subscriber's "
             "topics (a filter that lists the values, or topic_allow)", style="bold red")
    )  # fmt: skip


def _print_parts_and_sessions(report: StatusReport) -> None:
    parts = Table(
        "part", "checkpoint", "lag (events)", "lag (s)", "skipped by operator", "owner", "state"
    )
    for p in report.parts:
        parts.add_row(
            p.part, p.checkpoint, events(p.lag), f"{p.lag.seconds:.1f}", skipped(p.skipped),
            p.owner or "-", _part_state(p),
        )  # fmt: skip
    out.print(parts)
    print_estimate_note(p.lag for p in report.parts)
    _print_halts(report.parts)
    _print_waits(report.parts)
    print_skips([SkipLine(p.part, p.checkpoint, p.skipped) for p in report.parts])
    for name, skips in report.skips.items():
        print_operator_skips(name, skips)
    sessions = Table("session", "host", "pid", "heartbeat (s ago)", "parts")
    for s in report.sessions:
        sessions.add_row(
            str(s.id), s.hostname, str(s.pid), f"{s.heartbeat_age_s:.1f}", str(s.parts)
        )
    out.print(sessions)


def _print_horizon(report: StatusReport) -> None:
    if not report.horizon_holders_complete:
        err.print(
            Text("the details of other roles' sessions are hidden from this role (it lacks "
                 "pg_read_all_stats): a transaction holding publication back shows "
                 "without its age, state and query start; run status as the owner, or see "
                 "`outbox-relay grant --read-all-stats`", style="yellow")
        )  # fmt: skip
    if report.horizon_holders:
        holders = Table("pid", "xid", "age (s)", "state", "application", "query start")
        for h in report.horizon_holders:
            if h.gid is not None:  # no session: name it for ROLLBACK/COMMIT PREPARED
                holders.add_row(
                    "-", h.xid, _hidden_or(h.age_s, "{:.1f}"), "prepared",
                    f"gid {h.gid!r}, owner {h.owner}, database {h.database}", "-",
                )  # fmt: skip
                continue
            holders.add_row(
                str(h.pid), h.xid, _hidden_or(h.age_s, "{:.1f}"), _hidden_or(h.state),
                _hidden_or(h.application_name), _hidden_or(h.query_start),
            )  # fmt: skip
        out.print(Text("open transactions holding publication back", style="bold"))
        out.print(holders)


def _hidden_or(value: Any, fmt: str = "{}") -> str:
    """A pg_stat_activity detail, or 'hidden' where this role may not see it."""
    return "hidden" if value is None else fmt.format(value)


def _part_state(part: PartLine) -> Text:
    if part.skipped.beyond_horizon:
        return Text("BEYOND HORIZON", style="bold red")
    if part.halted is not None:
        return Text("HALTED", style="bold red")
    if part.paused:
        return Text("paused", style="yellow")
    return Text("WAITING", style="bold yellow") if part.waiting else Text("active")


def _print_halts(parts: list[PartLine]) -> None:
    """Halted parts publish nothing until resumed: say so where it cannot be missed."""
    halted = [p for p in parts if p.halted is not None]
    if not halted:
        return
    out.print(
        Text(f"{len(halted)} halted part(s): nothing is published for them until "
             "`outbox-relay subscribers resume NAME` (after a fix), or `outbox-relay "
             "subscribers skip NAME --event MESSAGE_ID` of the event it names", style="bold red")
    )  # fmt: skip
    for p in halted:
        # Unwrapped: the error ends with the command to copy, which a wrap would break.
        out.print(Text.assemble((f"  {p.part}: ", "red"), p.halted or ""), soft_wrap=True)


def _print_waits(parts: list[PartLine]) -> None:
    """Waiting parts publish nothing until the cause is fixed, and then go on by
    themselves: say what each waits for, since when, and what fixes it."""
    waiting = [(p.part, p.waiting) for p in parts if p.waiting and not (p.halted or p.paused)]
    if not waiting:
        return
    out.print(
        Text(f"{len(waiting)} waiting part(s): nothing is published for them until what "
             "they wait for is fixed; they then go on by themselves, with no `resume`",
             style="bold yellow")
    )  # fmt: skip
    for part, wait in waiting:
        since = wait.since.isoformat(timespec="seconds")
        line = Text.assemble((f"  {part}: ", "yellow"), f"waiting since {since}: {wait.error}")
        out.print(line, soft_wrap=True)  # unwrapped, as a halt: it names the command to copy


def _status(store: Store, max_created_topics: int) -> StatusReport:
    sessions = [Session.from_row(row) for row in store.list_sessions()]
    names = {s.id: f"{s.hostname}:{s.pid}" for s in sessions}
    waits = store.part_waits()
    subscribers = subscriber_statuses(store)
    parts = [
        PartLine(
            part=f"{p.state.name}/{p.state.part}",
            checkpoint=str(p.state.checkpoint),
            lag=p.lag,
            skipped=p.skipped,
            owner=names.get(p.state.owner) if p.state.owner else None,
            paused=subscriber.state.subscriber.paused,
            halted=p.state.halted_error,
            waiting=waits.get(PartId(p.state.name, p.state.part)),
        )
        for subscriber in subscribers
        for p in subscriber.parts
    ]
    skips = operator_skips(store, [s.state.subscriber_id for s in subscribers])
    return StatusReport(
        parts=parts,
        skips={s.state.subscriber.name: skips[s.state.subscriber_id] for s in subscribers},
        sessions=sessions,
        horizon_holders=store.horizon_holders(),
        horizon_holders_complete=store.sees_all_backends(),
        topic_budget=_topic_budget(store, max_created_topics),
    )


def _topic_budget(store: Store, cap: int) -> TopicBudget | None:
    from relay import wiring

    record = wiring.topic_record(lambda: nullcontext(store.conn), store.schema)
    used = record.row_topics()
    return None if used is None else TopicBudget(used, cap)
