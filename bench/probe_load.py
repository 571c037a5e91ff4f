"""What finding new rows costs Postgres: the commit probe, idle and under load, with 1
and with 100 subscriber parts on one in-process relay.

For each case the relay runs for a window; the figures are Postgres's transactions per
second (``pg_stat_database.xact_commit`` of the database: every probe and every part's
poll is one autocommit statement) and the CPU the whole Postgres server used, in cores
(utime + stime of every process of the server, from ``/proc``). Under load, an app
writer commits one event per transaction at ``scale.latency_rate`` per second.

There is no baseline: the NOTIFY trigger it replaced cost nothing here, but taxed every
writer's commit instead (see ``write_path``). The four cases take turns,
``scale.repetitions`` rounds (bench/method.py), each after a CHECKPOINT and a pause; each
figure is the median of its runs, with their range.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from bench.harness import Figure, Scale, Stack, relay_settings
from bench.method import Samples, interleave, settle
from relay.daemon import Relay
from relay.write.outbox import Outbox

WINDOW_S = 8.0
WARMUP_S = 2.0


def run(stack: Stack, scale: Scale) -> list[Figure]:
    cases = {(parts, loaded): f"{parts} part{'s' if parts > 1 else ''}, "
             f"{'1k ev/s' if loaded else 'idle'}"
             for parts in (1, 100) for loaded in (False, True)}  # fmt: skip
    cores: dict[str, list[float]] = {label: [] for label in cases.values()}

    def case(parts: int, loaded: bool) -> Callable[[], float]:
        def once() -> float:
            qps, used = _measure(stack, parts, scale.latency_rate if loaded else 0)
            cores[cases[parts, loaded]].append(used)
            return qps

        return once

    qps = interleave(
        {label: case(*key) for key, label in cases.items()},
        scale.repetitions,
        before_each=lambda: settle(stack.postgres.url),
    )
    figures: list[Figure] = []
    for (_, loaded), label in cases.items():
        details = {"window_s": WINDOW_S, "rate": scale.latency_rate if loaded else 0}
        figures.append(
            Figure.of("probe_load", f"postgres tx/s, {label}", qps[label], "tx/s", details=details)
        )
        figures.append(
            Figure.of("probe_load", f"postgres CPU, {label}", Samples(tuple(cores[label])),
                      "cores", details=details)
        )  # fmt: skip
    return figures


def _measure(stack: Stack, parts: int, rate: int) -> tuple[float, float]:
    url = stack.database(f"probe{parts}_{rate}")
    prefix = stack.topic_prefix("probe")
    subscribers = [
        {"name": f"s{i}", "topic": f"{prefix}.s{i}.{{aggregate_type}}", "value_format": "json"}
        for i in range(parts)
    ]
    relay = Relay(relay_settings(stack, url, "probe", subscribers=subscribers))
    relay.start()
    stop = threading.Event()
    writer = threading.Thread(target=_write, args=(url, rate, stop), daemon=True)
    try:
        time.sleep(WARMUP_S + parts * 0.05)  # every part recovered
        if rate:
            writer.start()
            time.sleep(WARMUP_S)
        before_tx, before_cpu, started = _xacts(url), _server_cpu(stack), time.monotonic()
        time.sleep(WINDOW_S)
        after_tx, after_cpu, ended = _xacts(url), _server_cpu(stack), time.monotonic()
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        relay.stop()
    elapsed = ended - started
    return (after_tx - before_tx) / elapsed, (after_cpu - before_cpu) / elapsed


def _write(url: str, rate: int, stop: threading.Event) -> None:
    outbox = Outbox(None)
    with psycopg.connect(url, autocommit=True) as conn:
        i, start = 0, time.monotonic()
        while not stop.is_set():
            with conn.transaction():
                outbox.append(conn, aggregate_type="order", aggregate_id=str(i % 1000),
                              event_type="OrderPlaced", payload={"i": i})  # fmt: skip
            i += 1
            time.sleep(max(0.0, start + i / rate - time.monotonic()))


def _xacts(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        # Our own two look-ups count too; negligible against a window of seconds.
        return int(row[0])


def _server_cpu(stack: Stack) -> float:
    """CPU seconds used so far by the postmaster and its children (live ones)."""
    root = stack.postgres.pid
    assert root is not None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(proc.name), int(fields[1])
        if root in (pid, ppid):
            total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / ticks
