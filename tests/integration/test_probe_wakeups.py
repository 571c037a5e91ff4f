"""The commit probe says which aggregate types a change concerns (Postgres), so that a
relay wakes only the parts that can have rows of them (issue #30, fan-out cost)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from relay.probe import CommitProbe
from tests.support import wait_until


def _append(writer_db: psycopg.Connection[Any], *types: str) -> None:
    with writer_db.transaction():
        for n, aggregate_type in enumerate(types):
            writer_db.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES (%s, %s, 'Happened', '{}')",
                (aggregate_type, f"k{n}"),
            )


def test_the_probe_wakes_with_the_aggregate_types_committed_since_its_last_look(
    relay_url: str, writer_db: psycopg.Connection[Any]
) -> None:
    _append(writer_db, "before")
    woken: list[frozenset[str] | None] = []
    lock = threading.Lock()

    def wake(types: frozenset[str] | None = None) -> None:
        with lock:
            woken.append(types)

    def seen() -> list[frozenset[str] | None]:
        with lock:
            return list(woken)

    probe = CommitProbe(
        lambda: psycopg.connect(relay_url), "public", wake, interval=0.01, idle_interval=0.01
    )
    probe.start()
    try:
        wait_until(lambda: seen() == [None], what="the first look: every part")
        _append(writer_db, "alpha")
        wait_until(lambda: len(seen()) == 2, what="a wake-up for alpha")
        _append(writer_db, "beta", "gamma", "beta")
        wait_until(lambda: len(seen()) >= 3, what="a wake-up for beta and gamma")
    finally:
        probe.stop()
        probe.join(10)
    assert seen()[1] == frozenset({"alpha"})
    # Each wake-up names the types committed since the one before, and nothing else.
    later = set().union(*(types or {"?"} for types in seen()[2:]))
    assert later == {"beta", "gamma"}
