"""Per-row write costs beyond the relay's triggers, on a big outbox.

* ``message_id``: a unique index on random UUIDs (``gen_random_uuid()``) puts every
  insert on a random leaf page; once the index outgrows memory, that is a read and a
  dirty page per row. Measured: 16 pgbench writers on an outbox already holding
  ``scale.big_backlog`` rows (10M at ``--scale full``), the default against a
  time-ordered UUIDv7 default (same column, same index).
* ``aggregate_version``: event-sourced appends fire the stream-order trigger (a version
  must follow the one before it). Measured: the same append with and without it.

Each pair follows bench/method.py: the two sides alternate, ``scale.repetitions`` rounds,
each run after a CHECKPOINT and a pause; figures are medians with their ranges.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg

from bench.harness import Figure, Scale, Stack, fill_outbox
from bench.method import interleave, settle
from bench.write_path import pgbench_tps
from relay.localstack.postgres import find_pg_binary

WRITERS = 16
PLAIN = """INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', 'k', 'OrderPlaced', '{"order_id": "1"}');
"""
# Each client appends to streams of its own (pgbench's :client_id), so no two writers
# race for a version: the figure is the trigger's cost, not conflict retries.
APPEND = """\\set k random(1, 100000)
\\set s :client_id * 1000000 + :k
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'stream', :s, coalesce(max(aggregate_version), 0) + 1, 'Appended', '{}'
  FROM outbox WHERE aggregate_type = 'stream' AND aggregate_id = :s::text;
"""
# Time-ordered UUID (RFC 9562 version 7): 48 bits of Unix milliseconds, then random
# bits, with the version and variant bits set. Consecutive ids land on the same leaf.
UUID_V7 = """
CREATE OR REPLACE FUNCTION bench_uuid_v7() RETURNS uuid LANGUAGE sql VOLATILE AS $$
  SELECT encode(
           set_bit(set_bit(
             overlay(uuid_send(gen_random_uuid())
                     PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                     FROM 1 FOR 6),
             52, 1), 53, 1),
           'hex')::uuid
$$;
"""


def run(stack: Stack, scale: Scale) -> list[Figure]:
    pgbench = shutil.which("pgbench") or find_pg_binary("pgbench")
    seconds = max(3, int(scale.latency_seconds / 2))
    url = stack.database("write_costs")
    fill_outbox(url, scale.big_backlog)
    with tempfile.TemporaryDirectory() as tmp:
        plain, append = Path(tmp) / "plain.sql", Path(tmp) / "append.sql"
        plain.write_text(PLAIN)
        append.write_text(APPEND)
        _execute(url, UUID_V7)

        def tps(script: Path, *statements: str) -> Callable[[], float]:
            def once() -> float:
                _execute(url, *statements)
                return pgbench_tps(pgbench, url, script, WRITERS, seconds)

            return once

        def settled() -> None:
            settle(url)

        ids = interleave(
            {"random": tps(plain, f"{DEFAULT_ID} gen_random_uuid()"),
             "v7": tps(plain, f"{DEFAULT_ID} bench_uuid_v7()")},
            scale.repetitions, before_each=settled,
        )  # fmt: skip
        _execute(url, f"{DEFAULT_ID} gen_random_uuid()")
        checks = interleave(
            {"check": tps(append, f"{STREAM_ORDER} ENABLE TRIGGER outbox_check_stream_order"),
             "none": tps(append, f"{STREAM_ORDER} DISABLE TRIGGER outbox_check_stream_order")},
            scale.repetitions, before_each=settled,
        )  # fmt: skip
        _execute(url, f"{STREAM_ORDER} ENABLE TRIGGER outbox_check_stream_order")
    rows = {"rows": scale.big_backlog, "writers": WRITERS, "seconds": seconds}
    return [
        Figure.of("write_costs", f"INSERT tx/s, random message_id, {scale.big_backlog:,} rows",
                  ids["random"], "tx/s", ids["v7"], "UUIDv7 message_id", None, rows),
        Figure.of("write_costs", "stream append tx/s with the stream-order trigger",
                  checks["check"], "tx/s", checks["none"], "trigger disabled", None, rows),
    ]  # fmt: skip


DEFAULT_ID = "ALTER TABLE outbox ALTER COLUMN message_id SET DEFAULT"
STREAM_ORDER = "ALTER TABLE outbox"


def _execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)
