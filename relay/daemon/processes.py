"""One relay on every core: ``workers`` member processes under one supervisor.

Python runs one thread's bytecode at a time, so a relay process publishes on about one
core however many parts it runs. With ``workers = N`` (``outbox-relay run --workers N``)
the relay starts N member processes instead. Each is a whole relay with its own session
(docs/design.md §4): the parts spread over them as over peers on other hosts, with the
same claims, fencing and hand-overs, so nothing about exactly-once changes.

The supervisor (this process) serves ``/metrics``, ``/healthz`` and ``/readyz`` for all
of them (the probes on the probe port too), from reports each member sends on request over a pipe. It restarts a member
that dies (its parts wait for its session to expire, as after a crash), stops them all
on SIGTERM, and fails as a whole when a member meets a fatal error, which every member
would meet alike (a bad setting, a missing privilege).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from relay import wiring
from relay.core import redact
from relay.core.log_fields import log_extra
from relay.core.model import PartId
from relay.core.ports import StatusStore
from relay.core.settings import Settings
from relay.daemon.lifecycle import Relay, start_with_retries, tune_process
from relay.daemon.metrics import HealthServer
from relay.errors import ConfigError, RelayError
from relay.observability import logs

logger = logging.getLogger(__name__)

# A member that has not answered a report request within this long counts as stuck.
_REPORT_TIMEOUT_S = 5.0
# A member that fails this soon after it started would fail again: the relay stops.
_FATAL_WITHIN_S = 10.0
_RESTART_DELAY_S = (1.0, 30.0)  # first and longest wait before a restart


@dataclass
class MemberReport:
    """What a member process tells the supervisor: its health and its counters."""

    healthy: tuple[bool, str]
    ready: tuple[bool, str]
    totals: dict[PartId, Counter[str]] = field(default_factory=dict)
    states: dict[PartId, str] = field(default_factory=dict)
    waits: dict[PartId, str] = field(default_factory=dict)
    key_space_changes: Counter[str] = field(default_factory=Counter)
    retention: Counter[str] = field(default_factory=Counter)


def member_main(settings: Settings, conn: Connection) -> None:
    """A member process: run a relay, answer report requests, stop when told to or
    when the supervisor is gone (its end of the pipe closes)."""
    # A new interpreter (spawned): this is its entry point, as the CLI is the parent's.
    logs.configure(settings.log_level, settings.log_format)
    redact.remember(settings.kafka_secrets())  # as load_settings did in the parent
    relay = Relay(settings)
    # The supervisor stops members with SIGTERM, which also ends a start-up still
    # waiting for Postgres or Kafka. Ctrl-C reaches the whole process group: only the
    # supervisor acts on it, and stops the members in order.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: relay.request_stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stop_when_orphaned(relay)
    tune_process()
    try:
        start_with_retries(relay)
    except RelayError as exc:
        conn.send(("fatal", f"{type(exc).__name__}: {exc}", isinstance(exc, ConfigError)))
        return
    try:
        _serve_reports(relay, conn)
    finally:
        relay.stop()


def _stop_when_orphaned(relay: Relay) -> None:
    """Stop when the supervisor dies without stopping us (SIGKILL, the OOM killer). The
    pipe tells only once reports are served; a start-up waiting for Postgres or Kafka
    would otherwise retry for ever."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the supervisor's process is gone
        if not relay.wait(0):
            logger.warning(
                "the supervisor is gone: this member stops", extra=log_extra("supervisor_gone")
            )
            relay.request_stop()

    threading.Thread(target=watch, name="relay-orphan-watch", daemon=True).start()


def _serve_reports(relay: Relay, conn: Connection) -> None:
    while not relay.wait(0):
        try:
            if conn.poll(0.2) and conn.recv() == "report":
                conn.send(("report", _report(relay)))
        except (EOFError, OSError):
            logger.warning(
                "the supervisor is gone: this member stops", extra=log_extra("supervisor_gone")
            )
            return


def _report(relay: Relay) -> MemberReport:
    totals, states = relay.part_totals(), relay.part_states()
    return MemberReport(
        relay.healthy(),
        relay.ready(),
        totals,
        states,
        relay.part_waits(),
        relay.key_space_changes(),
        relay.retention_totals(),
    )


class Member:
    """The supervisor's handle on one member process, restarted when it dies."""

    def __init__(self, index: int, settings: Settings) -> None:
        self.index = index
        self._settings = settings
        self._lock = threading.Lock()  # one request at a time on the pipe
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._started_at = 0.0
        self.last: MemberReport | None = None
        self._fatal: tuple[str, bool] | None = None  # (message, is a ConfigError)
        # Counters of earlier incarnations, so that totals never go down.
        self.retired: list[MemberReport] = []

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a threaded process
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=member_main,
            args=(self._settings, child),
            name=f"outbox-relay-worker-{self.index}",
            daemon=False,
        )
        process.start()
        child.close()
        if self._conn is not None:
            self._conn.close()  # the previous incarnation's end
        self._process, self._conn, self._started_at = process, parent, time.monotonic()
        logger.info(
            "started worker process %s (pid %s)",
            self.index,
            process.pid,
            extra=log_extra("worker_process_started", worker=self.index, pid=process.pid),
        )

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def ask(self) -> MemberReport | None:
        """The member's report; None when it is dead or does not answer in time."""
        with self._lock:
            conn = self._conn
            if conn is None or not self.alive:
                return None
            try:
                conn.send("report")
                if not conn.poll(_REPORT_TIMEOUT_S):
                    return None
                kind, *payload = conn.recv()
            except (EOFError, OSError):
                return None
            if kind == "fatal":
                self._fatal = (payload[0], bool(payload[1]))
                return None
            self.last = payload[0]
            return self.last

    def fatal(self) -> tuple[str, bool] | None:
        """The fatal error the (exited) member reported, if any."""
        with self._lock:
            conn = self._conn
            try:
                while conn is not None and not self.alive and conn.poll(0):
                    kind, *payload = conn.recv()
                    if kind == "fatal":
                        self._fatal = (payload[0], bool(payload[1]))
            except (EOFError, OSError):
                pass
            return self._fatal

    def history(self) -> list[MemberReport]:
        """The last report of every incarnation, this one's included."""
        return [*self.retired, *([self.last] if self.last is not None else [])]

    def failed_at_start(self) -> bool:
        """Exited on its own, with an error, soon after it started: it would again.
        (Killed by a signal, as by the OOM killer, it is restarted.)"""
        process = self._process
        code = None if process is None else process.exitcode
        young = time.monotonic() - self._started_at < _FATAL_WITHIN_S
        return young and code is not None and code > 0

    def restart(self) -> None:
        """Start a new incarnation; the old one's counters are kept."""
        if self.last is not None:
            self.retired.append(self.last)
        self.last, self._fatal = None, None
        self.start()

    def stop(self) -> None:
        if self._process is not None and self.alive:
            self._process.terminate()  # SIGTERM: the member finishes its batches

    def join(self, deadline: float) -> None:
        process = self._process
        if process is None:
            return
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning(
                "worker process %s did not stop in time: killing it",
                self.index,
                extra=log_extra("worker_process_killed", worker=self.index),
            )
            process.kill()
            process.join(5.0)


class RelayProcesses:
    """A relay of ``settings.workers`` member processes; as :class:`Relay` to the CLI
    (start, wait, request_stop, stop) and to the HTTP endpoints (health and counters)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        member_settings = settings.model_copy(update={"workers": 1, "metrics_enabled": False})
        self.members = [Member(i, member_settings) for i in range(settings.workers)]
        self._stop_requested = threading.Event()
        self._stopping = threading.Event()
        self._failure: RelayError | None = None
        self._watcher: threading.Thread | None = None
        self.http: HealthServer | None = None

    def start(self) -> None:
        s = self.settings
        if s.metrics_enabled and self.http is None:
            self.http = HealthServer(self, self._open_store, s)
            self.http.start()
        for member in self.members:
            member.start()
        self._watcher = threading.Thread(target=self._watch, name="relay-workers", daemon=True)
        self._watcher.start()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop_requested.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop every member (each finishes its batches within ``timeout``); raises the
        fatal error a member met, if one did."""
        deadline = time.monotonic() + (
            self.settings.shutdown_timeout if timeout is None else timeout
        )
        self._stopping.set()
        self._stop_requested.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        for member in self.members:
            member.stop()
        for member in self.members:
            member.join(deadline + 2.0)  # a member's own deadline first, then ours
        if self.http is not None:
            self.http.stop()
            self.http = None
        logger.info("relay stopped", extra=log_extra("relay_stopped"))
        if self._failure is not None:
            raise self._failure

    # -- supervision -------------------------------------------------------------------

    def _watch(self) -> None:
        delay = {m.index: _RESTART_DELAY_S[0] for m in self.members}
        while not self._stopping.wait(0.5):
            for member in self.members:
                if member.alive or self._stopping.is_set():
                    continue
                failure = self._failure_of(member)
                if failure is not None:
                    self._failure = failure
                    self._stop_requested.set()
                    return
                logger.error(
                    "worker process %s died: restarting it in %.0fs (its parts move to the "
                    "other workers once its session expires)",
                    member.index,
                    delay[member.index],
                    extra=log_extra(
                        "worker_process_died", worker=member.index, restart_in=delay[member.index]
                    ),
                )
                if self._stopping.wait(delay[member.index]):
                    return
                delay[member.index] = min(delay[member.index] * 2, _RESTART_DELAY_S[1])
                member.restart()

    def _failure_of(self, member: Member) -> RelayError | None:
        """The error to stop the whole relay with, when ``member`` cannot be restarted."""
        reported = member.fatal()
        if reported is not None:
            message, config = reported
            error = f"worker process {member.index}: {message}"
            return ConfigError(error) if config else RelayError(error)
        if member.failed_at_start():
            return RelayError(
                f"worker process {member.index} failed within {_FATAL_WITHIN_S:.0f}s of "
                "starting (see its log above)"
            )
        return None

    # -- observability (the HTTP endpoints) ----------------------------------------------

    def _reports(self) -> list[MemberReport | None]:
        return [member.ask() for member in self.members]

    def healthy(self) -> tuple[bool, str]:
        """Liveness: every member process is alive and healthy."""
        if self._stopping.is_set():
            return True, "stopping"
        for member, report in zip(self.members, self._reports(), strict=True):
            if report is None:
                return False, f"worker process {member.index} is not answering"
            if not report.healthy[0]:
                return False, f"worker process {member.index}: {report.healthy[1]}"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Readiness: every member holds a live session."""
        if self._stopping.is_set():
            return False, "stopping"
        replies = []
        for member, report in zip(self.members, self._reports(), strict=True):
            if report is None:
                return False, f"worker process {member.index} is not answering"
            if not report.ready[0]:
                return False, f"worker process {member.index}: {report.ready[1]}"
            replies.append(f"worker {member.index} {report.ready[1]}")
        return True, "; ".join(replies)

    def part_totals(self) -> dict[PartId, Counter[str]]:
        """Cumulative statistics per part over every member and incarnation. Asks each
        member for a fresh report: part_states and key_space_changes, which a scrape
        reads right after, use those reports rather than ask again."""
        totals: dict[PartId, Counter[str]] = {}
        for member in self.members:
            member.ask()
            for report in member.history():
                for part, counts in report.totals.items():
                    totals.setdefault(part, Counter()).update(counts)
        return totals

    def part_states(self) -> dict[PartId, str]:
        states: dict[PartId, str] = {}
        for member in self.members:
            if member.last is not None:
                states.update(member.last.states)
        return states

    def part_waits(self) -> dict[PartId, str]:
        waits: dict[PartId, str] = {}
        for member in self.members:
            if member.last is not None:
                waits.update(member.last.waits)
        return waits

    def key_space_changes(self) -> Counter[str]:
        found: Counter[str] = Counter()
        for member in self.members:
            for report in member.history():
                found.update(report.key_space_changes)
        return found

    def retention_totals(self) -> Counter[str]:
        found: Counter[str] = Counter(pruned=0, failures=0)
        for member in self.members:
            for report in member.history():
                found.update(report.retention)
        return found

    def _open_store(self) -> StatusStore:
        return wiring.daemon_store(self.settings)
