"""Soak: the outbox's size under a steady write rate with retention on (issue #27).

One ``outbox-relay run`` process publishes what one writer process commits at
``scale.soak_rate`` events/s for ``scale.soak_seconds`` (8 minutes at 3k ev/s by
default; about 90 s at ``--scale quick``). Both run as the roles `outbox-relay grant
--create` makes, as in production: the relay as the relay role, the writer as the
writer role; only the sampler and the set-up connect as the owner.

Retention is on and short, so that a run sees many prunes: rows older than
``soak_seconds / 8`` are pruned every ``soak_seconds / 32``. With pruning working the
table holds about ``rate * (retention + prune_every)`` rows and its size levels off
once autovacuum reuses the pruned space; without it, the table grows with every
event written.

Every ``soak_seconds / 40`` the sampler records ``pg_total_relation_size('outbox')``
(table, indexes and TOAST), the row count, the dead rows and how many times
autovacuum has run on the outbox. The table fills up to its retention window first:
the figures leave out the samples before ``retention + 2 * prune_every`` and compare
the mean of the last third of the rest with the mean of its first third. A flat table
is a ratio near 1 (target: at most 1.2); so is the size at the end against the size
at the start of the last third (target: at most 1.05), which tells a table that has
levelled off from one still growing. Details carry every sample, the write rate
achieved, and how many prunes the relay logged or failed.

Not a CI test: run it with ``./dev.sh bench --only soak [--scale quick]``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from statistics import mean
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from bench.harness import (
    SPAWN,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    create_topics,
    order_payload,
    reap,
    receive,
    spawn_child,
)
from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import StartFrom, Subscriber, ValueFormat
from relay.ops.roles import grant_roles

RELAY_ROLE = "outbox_bench_relay"
WRITER_ROLE = "outbox_bench_writer"
TICK_S = 0.01  # the writer commits one transaction of rate * TICK_S events per tick
KEYS = 1000
SAMPLES = 40


@dataclass(frozen=True)
class Sample:
    at_s: float  # since the writer started
    bytes: int
    rows: int
    dead_rows: int
    autovacuums: int


# -- the benchmark ---------------------------------------------------------------------


def run(stack: Stack, scale: Scale) -> list[Figure]:
    owner_url = stack.database("soak")
    relay_url, writer_url = _grant(owner_url)
    retention = scale.soak_seconds / 8
    prune_every = retention / 4
    prefix = stack.topic_prefix("soak")
    topic = f"{prefix}.order"
    create_topics(stack.bootstrap, [topic], partitions=3)
    with psycopg.connect(relay_url, autocommit=True) as conn:  # `subscribers add`
        sub = Subscriber(
            "soak", topic=f"{prefix}.{{aggregate_type}}", value_format=ValueFormat.JSON
        )
        OutboxStore(conn).add(sub, StartFrom.BEGINNING)
    relays = RelayProcesses(
        stack, relay_url, "soak", prune_every=prune_every, retention=retention, log_level="INFO"
    )
    with relays:
        samples, written, seconds = _soak(relays, owner_url, writer_url, scale)
    log = "\n".join(path.read_text(errors="replace") for path in relays.logs)
    return _figures(samples, written, seconds, scale, retention, prune_every, log)


def _soak(
    relays: RelayProcesses, owner_url: str, writer_url: str, scale: Scale
) -> tuple[list[Sample], int, float]:
    stop = SPAWN.Event()
    writer, result = spawn_child(_write, writer_url, scale.soak_rate, stop)
    samples: list[Sample] = []
    started = time.monotonic()
    interval = scale.soak_seconds / SAMPLES
    try:
        with psycopg.connect(owner_url, autocommit=True) as conn:
            while (elapsed := time.monotonic() - started) < scale.soak_seconds:
                relays.check_alive()
                if not writer.is_alive():
                    raise RuntimeError(f"the writer exited with code {writer.exitcode}")
                samples.append(_sample(conn, elapsed))
                time.sleep(max(0.0, interval * len(samples) - (time.monotonic() - started)))
            samples.append(_sample(conn, time.monotonic() - started))
        stop.set()
        written, seconds = receive(result, writer, timeout=60)
    finally:
        stop.set()
        reap(writer)
    return samples, written, seconds


def _sample(conn: psycopg.Connection[Any], elapsed: float) -> Sample:
    row = conn.execute(
        "SELECT pg_total_relation_size('outbox'), (SELECT count(*) FROM outbox),"
        " n_dead_tup, autovacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"
    ).fetchone()
    assert row is not None
    return Sample(round(elapsed, 1), *(int(value) for value in row))


def _figures(
    samples: list[Sample],
    written: int,
    seconds: float,
    scale: Scale,
    retention: float,
    prune_every: float,
    log: str,
) -> list[Figure]:
    warm = [s for s in samples if s.at_s >= retention + 2 * prune_every] or samples
    third = max(1, len(warm) // 3)
    first, last = warm[:third], warm[-third:]
    achieved = round(written / seconds, 1) if seconds else 0.0
    details = {
        "rate_target_per_s": scale.soak_rate,
        "rate_achieved_per_s": achieved,
        "written": written,
        "seconds": round(seconds, 1),
        "retention_s": retention,
        "prune_every_s": prune_every,
        "roles": {"relay": RELAY_ROLE, "writer": WRITER_ROLE},
        "prunes_logged": log.count("pruned "),
        "prune_failures": log.count("permission denied"),
        "compared_from_s": warm[0].at_s,
        # [seconds, bytes, rows, dead rows, autovacuum runs]
        "samples": [[s.at_s, s.bytes, s.rows, s.dead_rows, s.autovacuums] for s in samples],
    }
    mib = 1024 * 1024
    return [
        Figure(
            benchmark="soak",
            name="outbox size, last third of the run",
            value=mean(s.bytes for s in last) / mib,
            unit="MiB",
            baseline=mean(s.bytes for s in first) / mib,
            baseline_name="first third (after filling the retention window)",
            target="ratio<=1.2",
            details=details,
        ),
        Figure(
            benchmark="soak",
            name="outbox rows, last third of the run",
            value=mean(s.rows for s in last),
            unit="rows",
            baseline=mean(s.rows for s in first),
            baseline_name="first third (after filling the retention window)",
            target="ratio<=1.2",
        ),
        Figure(
            benchmark="soak",
            name="outbox size at the end",
            value=last[-1].bytes / mib,
            unit="MiB",
            baseline=last[0].bytes / mib,
            baseline_name="at the start of the last third",
            target="ratio<=1.05",
        ),
        Figure(
            benchmark="soak",
            name="write rate achieved",
            value=achieved,
            unit="ev/s",
            baseline=float(scale.soak_rate),
            baseline_name="target rate",
        ),
    ]


# -- the roles ---------------------------------------------------------------------------


def _grant(owner_url: str) -> tuple[str, str]:
    """`outbox-relay grant --create` for the two roles; their URLs. The local Postgres
    checks passwords, so each role gets one, for this run."""
    password = secrets.token_urlsafe(16)
    with psycopg.connect(owner_url, autocommit=True) as conn:
        grant_roles(conn, "public", relay_role=RELAY_ROLE, writer_role=WRITER_ROLE, create=True)
        for role in (RELAY_ROLE, WRITER_ROLE):
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(password)
                )
            )
    return _as(owner_url, RELAY_ROLE, password), _as(owner_url, WRITER_ROLE, password)


def _as(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    login = f"{role}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=login))


# -- the writer process ------------------------------------------------------------------


def _write(url: str, rate: int, stop: Event, out: Connection) -> None:
    """Commit ``rate`` events/s as plain-SQL inserts (the writer role's INSERT), paced
    by an absolute schedule, until ``stop``; sends (events written, seconds)."""
    per_tick = max(1, round(rate * TICK_S))
    payload = json.dumps(order_payload())
    insert = (
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'order', (n %% %s::bigint)::text, 'OrderPlaced', %s::jsonb"
        " FROM generate_series(%s::bigint, %s::bigint) AS n"
    )
    written = 0
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.monotonic()
        while not stop.is_set():
            conn.execute(insert, (KEYS, payload, written, written + per_tick - 1))
            written += per_tick
            due = started + written / rate
            time.sleep(max(0.0, due - time.monotonic()))
        seconds = time.monotonic() - started
    out.send((written, seconds))
    out.close()
