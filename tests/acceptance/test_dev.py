"""``outbox-relay dev`` end to end: the embedded stack runs, reports, and leaves nothing behind."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import local_workdir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with local_workdir("outbox-dev-test-", "dev") as folder:
        yield folder


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text}"
    return int(match[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes that contain any of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(f"{entry.name}: {cmdline}")
    return found


def test_dev_runs_reports_and_cleans_up(workdir: Path) -> None:
    result = subprocess.run(
        [*_cli(), "dev", "--duration", "12", "--rate", "300", "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    _assert_reported_and_cleaned_up(output, workdir)
    # Off a terminal, plain lines as it runs (issue #52: nothing until the end before).
    progress = [line for line in result.stdout.splitlines() if re.match(r" +\d+ s  written ", line)]
    assert len(progress) >= 2, result.stdout
    assert "; published " in progress[-1] and "; lag " in progress[-1]


def test_sigterm_stops_dev_as_ctrl_c_does(workdir: Path) -> None:
    """A process manager's SIGTERM: the ordered shutdown, the summary, nothing left."""
    proc = subprocess.Popen(
        [*_cli(), "dev", "--rate", "300", "--workdir", str(workdir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "outbox-relay dev exited early:\n" + "".join(lines)
        lines.append(line)
        if "bootstrap servers" in line:
            break
    time.sleep(5)  # events flow
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    _assert_reported_and_cleaned_up(output, workdir)


def _assert_reported_and_cleaned_up(output: str, workdir: Path) -> None:
    summary = output[output.index("Summary:") :]
    assert _number(r"consumed (\d+)", summary) > 0
    assert _number(r"(\d+) duplicates", summary) == 0
    assert _number(r"(\d+) rolled-back leaks", summary) == 0
    assert _number(r"Published (\d+) events", summary) > 0

    pg_port = _number(r"postgresql://postgres@127\.0\.0\.1:(\d+)/outbox_demo", output)
    broker_port = _number(r"bootstrap servers 127\.0\.0\.1:(\d+)", output)
    assert not _port_open(pg_port), "postgres still listening"
    assert not _port_open(broker_port), "broker still listening"
    leftovers = _processes_mentioning(str(workdir), f"tcp://127.0.0.1:{broker_port}")
    assert not leftovers, f"processes left behind: {leftovers}"


def _local(workdir: Path, stderr: Any) -> subprocess.Popen[str]:
    """``outbox-relay local`` started, its stdout read by the caller."""
    return subprocess.Popen(
        [*_cli(), "local", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def test_local_runs_postgres_and_kafka_for_your_own_app(workdir: Path) -> None:
    """``outbox-relay local``: the servers only, with the settings to export printed;
    an app writes, ``outbox-relay run`` publishes, and SIGTERM stops it all cleanly."""
    import signal
    import time

    import psycopg

    proc = _local(workdir, subprocess.DEVNULL)
    try:
        settings: dict[str, str] = {}
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while len(settings) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "outbox-relay local exited early"
            if line.startswith("export "):
                # As a shell reads it (the values are quoted).
                key, _, value = shlex.split(line)[1].partition("=")
                settings[key] = value
        assert set(settings) == {"RELAY_DATABASE_URL", "RELAY_BOOTSTRAP_SERVERS"}
        with psycopg.connect(settings["RELAY_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(  # migrated: the app can write at once
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', '1', 'OrderPlaced',"
                """ '{"order_id": "1", "customer_id": "c", "amount_cents": 1}')"""
            )
        from tests.support import consume

        relay = subprocess.Popen(
            [*_cli(), "run"],
            cwd=ROOT,  # its schemas/ folder
            env={**os.environ, **settings, "RELAY_METRICS_PORT": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            [record] = consume(
                settings["RELAY_BOOTSTRAP_SERVERS"], ["outbox.event.order"], 1, timeout=60
            )
            assert record.key == b"1"
        finally:
            relay.send_signal(signal.SIGTERM)
            assert relay.wait(60) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0


def test_local_ends_naming_a_server_that_died_and_stops_the_other(workdir: Path) -> None:
    """Issue #52: with its Postgres killed, ``outbox-relay local`` ran on, printing
    nothing, the exported URL pointing at a dead port."""
    import signal
    import time

    log = workdir.parent / "local.err"
    with log.open("w") as err:
        proc = _local(workdir, err)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        bootstrap = ""
        while not bootstrap and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "outbox-relay local exited early"
            if line.startswith("export RELAY_BOOTSTRAP_SERVERS="):
                bootstrap = shlex.split(line)[1].partition("=")[2]
        postmaster = int((workdir / "pg" / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGKILL)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    stderr = log.read_text()
    assert code == 1, stderr
    assert "Postgres stopped by itself (its log: " in stderr
    assert not _port_open(int(bootstrap.rpartition(":")[2])), "Kafka still listening"


def test_the_live_view_prints_consumed_records_verbatim() -> None:
    from rich.console import Console

    from relay.core.model import ConsumedRecord
    from relay.core.schemas import SchemaFolder
    from relay.localstack.demo import _recent_table, _shown

    registry = SchemaFolder.from_dir(ROOT / "schemas")
    payload = {"order_id": "[/red]", "customer_id": "c", "amount_cents": 1}
    value = registry.encode("OrderPlaced", payload)
    record = ConsumedRecord("t", 0, 0, b"[/]", value, [("event_type", b"[bold]Placed")])
    console = Console(width=200, record=True)
    console.print(_recent_table([_shown(record, registry)]))
    shown = console.export_text()
    assert "[/]" in shown and "[bold]Placed" in shown and '"order_id":"[/red]"' in shown
