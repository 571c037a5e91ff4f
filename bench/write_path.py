"""The application's write path under concurrency: what the outbox costs a writer.

pgbench runs 1, 4, 16 and 64 clients, each committing one INSERT per transaction, with
``fsync`` on (the harness's default), against the outbox as migrated: the relay's
triggers included. Two statements: the plain SQL of the README, and the append API's
statement (``INSERT ... RETURNING message_id``, what :meth:`relay.write.outbox.Outbox.append`
sends). Baseline: the same statements into the same table, indexes included, with no
relay trigger at all (``ALTER TABLE outbox DISABLE TRIGGER USER``), in the same run.
Each point follows bench/method.py: the two sides alternate, ``scale.repetitions``
rounds (A B A B …), each run on an emptied table after a CHECKPOINT and a pause; a
figure is the median of its runs, with their range and that of the rounds' ratios.

Target (the write-path issue): at 64 writers, ≥ 0.9x the trigger-free transactions/s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg

from bench.harness import Figure, Scale, Stack
from bench.method import Samples, interleave, settle
from relay.localstack.postgres import find_pg_binary

CLIENTS = (1, 4, 16, 64)
KEYS = 10_000  # aggregate ids drawn at random: concurrent writers rarely share a key
PLAIN = """\\set k random(1, {keys})
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', :k, 'OrderPlaced', '{{"order_id": "1", "customer_id": "c", "amount_cents": 1}}');
"""
APPEND = """\\set k random(1, {keys})
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, idempotency_key)
VALUES ('order', :k, NULL, 'OrderPlaced', '{{"order_id": "1", "customer_id": "c", "amount_cents": 1}}', '{{}}', NULL)
RETURNING message_id;
"""
_TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


def run(stack: Stack, scale: Scale) -> list[Figure]:
    pgbench = shutil.which("pgbench") or find_pg_binary("pgbench")
    url = stack.database("write_path")
    seconds = max(3, int(scale.latency_seconds / 2))
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {name: Path(tmp) / f"{name}.sql" for name in ("plain", "append")}
        scripts["plain"].write_text(PLAIN.format(keys=KEYS))
        scripts["append"].write_text(APPEND.format(keys=KEYS))
        for name, script in scripts.items():
            for clients in CLIENTS:
                with_triggers, without = _point(
                    pgbench, url, script, clients, seconds, scale.repetitions
                )
                target = "ratio>=0.9" if clients == 64 else None
                figures.append(
                    Figure.of("write_path", f"{name} INSERT tx/s, {clients} writers",
                              with_triggers, "tx/s", without, "same table, no relay trigger",
                              target, {"seconds": seconds, "keys": KEYS})
                )  # fmt: skip
    return figures


def _point(
    pgbench: str, url: str, script: Path, clients: int, seconds: int, times: int
) -> tuple[Samples, Samples]:
    """Transactions/s with the relay's triggers and without (same table), interleaved."""

    def side(triggers: bool) -> Callable[[], float]:
        def once() -> float:
            _set_triggers(url, enabled=triggers)
            try:
                return pgbench_tps(pgbench, url, script, clients, seconds)
            finally:
                _truncate(url)

        return once

    try:
        runs = interleave(
            {"triggers": side(True), "none": side(False)}, times, before_each=lambda: settle(url)
        )
    finally:
        _set_triggers(url, enabled=True)
    return runs["triggers"], runs["none"]


def pgbench_tps(pgbench: str, url: str, script: Path, clients: int, seconds: int) -> float:
    argv = [pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 4)),
            "-T", str(seconds), "-f", str(script), url]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    match = _TPS.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(match.group(1))


def _set_triggers(url: str, *, enabled: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE outbox {'ENABLE' if enabled else 'DISABLE'} TRIGGER USER")


def _truncate(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute("CHECKPOINT")
