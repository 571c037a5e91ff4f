"""Postgres's side of the fan-out (issue #30): its CPU per row fetched by 100 subscribers
of one aggregate type each (``fetch_batch_of_type``) against one unfiltered subscriber
(``fetch_batch``), on the same outbox, without Kafka or a relay.

The outbox holds the fan-out bench's rows (bench/fanout.py: 100 aggregate types in turn).
One side fetches every type's rows in batches, the types taking turns as parts of a relay
do (batch 1 of every type, then batch 2, ...); the other fetches every row in batches of
the same size. Each side runs on a fresh connection, with the relay's own fetch
(``OutboxStore.fetch``: binary, prepared), from the start of the outbox to its end. The
figure is the CPU time of that connection's backend per row: at 1.0x, splitting the
stream by type costs Postgres nothing. Wall time per row is reported beside it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.harness import BATCH, Figure, Scale, Stack, fill_outbox
from bench.method import Samples, interleave, own_cpu_seconds, settle
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import Position
from relay.core.ports import Selection

TYPES = 100
MAX_BYTES = 4 * 1024 * 1024  # the relay's default batch_max_bytes
MAX_ROW_BYTES = 2 * 1_048_588  # twice message.max.bytes, as the relay sets it


def run(stack: Stack, scale: Scale) -> list[Figure]:
    events = scale.fanout_events
    batch = min(BATCH, max(1, events // TYPES // 10))  # as bench/fanout.py
    url = stack.database("fanout_fetch")
    fill_outbox(url, events, types=TYPES)
    settle(url)
    walls: dict[str, list[float]] = {"of type": [], "unfiltered": []}

    def side(name: str, sweep: Callable[[OutboxStore, int], int]) -> Callable[[], float]:
        return backend_cpu_side(
            url, events, name, lambda conn: sweep(OutboxStore(conn), batch), walls
        )

    cpu = interleave(
        {"of type": side("of type", by_type), "unfiltered": side("unfiltered", unfiltered)},
        scale.repetitions,
    )
    details = {"events": events, "types": TYPES, "batch_size": batch}
    return [
        Figure.of("fanout_fetch", f"Postgres CPU us/row, {TYPES} one-type subscribers vs 1",
                  cpu["of type"], "us", cpu["unfiltered"], "1 unfiltered", None, details),
        Figure.of("fanout_fetch", f"fetch wall us/row, {TYPES} one-type subscribers vs 1",
                  Samples(tuple(walls["of type"])), "us", Samples(tuple(walls["unfiltered"])),
                  "1 unfiltered", None, details),
    ]  # fmt: skip


def backend_cpu_side(
    url: str,
    events: int,
    name: str,
    sweep: Callable[[psycopg.Connection[Any]], int],
    walls: dict[str, list[float]],
) -> Callable[[], float]:
    """A side of an interleaved sweep: ``sweep`` on a fresh connection, its figure the
    backend's CPU per row (its wall time per row goes to ``walls[name]``)."""

    def measure() -> float:
        with psycopg.connect(url, autocommit=True) as conn:
            pid = conn.info.backend_pid
            cpu, start = own_cpu_seconds(pid) or 0.0, time.perf_counter()
            rows = sweep(conn)
            wall = time.perf_counter() - start
            cpu = (own_cpu_seconds(pid) or 0.0) - cpu
        if rows != events:
            raise RuntimeError(f"{name}: fetched {rows} rows of {events}")
        walls[name].append(wall / rows * 1e6)
        return cpu / rows * 1e6

    return measure


def by_type(store: OutboxStore, batch: int) -> int:
    """Every type's rows, the types taking turns batch by batch; the rows fetched."""
    after = {f"order{i}": Position(0, 0) for i in range(TYPES)}
    fetched = 0
    while after:
        for name, checkpoint in list(after.items()):
            got = store.fetch(
                checkpoint,
                Selection(batch, MAX_BYTES, aggregate_types=frozenset({name}),
                          max_row_bytes=MAX_ROW_BYTES),
            )  # fmt: skip
            fetched += len(got.events)
            if got.full and got.read_to is not None:
                after[name] = got.read_to
            else:  # short: the type's every row is read
                del after[name]
    return fetched


def unfiltered(store: OutboxStore, batch: int) -> int:
    """Every row, in batches; the rows fetched."""
    checkpoint, fetched = Position(0, 0), 0
    while True:
        got = store.fetch(checkpoint, Selection(batch, MAX_BYTES, max_row_bytes=MAX_ROW_BYTES))
        fetched += len(got.events)
        if not got.full or got.read_to is None:
            return fetched
        checkpoint = got.read_to
