"""The relay's connection pool (relay/adapters/postgres/pool.py), without a server: what borrows, and
how often a refusal is told."""

from __future__ import annotations

import logging
import threading

import pytest

from relay.adapters.postgres.db import Refusal
from relay.adapters.postgres.pool import PooledStore, RelayPool, _Refusals
from relay.adapters.postgres.store import OutboxStore


def test_every_public_store_method_borrows_a_connection_of_the_pool() -> None:
    public = [
        n for n in dir(OutboxStore) if callable(getattr(OutboxStore, n)) and not n.startswith("_")
    ]
    # Its own methods, and its pieces' (session_queries, intervention_queries, ...).
    assert {"fetch", "advance", "claim", "skip", "key_space", "prune"} <= set(public)
    inherited = [n for n in public if getattr(PooledStore, n) is getattr(OutboxStore, n)]
    assert inherited == []


TOO_MANY = Refusal("too_many_clients", "Raise max_connections")


def test_a_refusal_is_told_once_until_a_connection_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.postgres.pool")
    refusals = _Refusals()
    for _ in range(5):
        refusals.refused("sorry, too many clients already", TOO_MANY)
    refusals.accepted()
    refusals.accepted()
    refusals.refused("sorry, too many clients already", TOO_MANY)
    told = [r.levelname for r in caplog.records if r.name == "relay.adapters.postgres.pool"]
    assert told == ["WARNING", "INFO", "WARNING"]
    assert "too many clients" in caplog.records[0].getMessage()


def test_the_pool_opens_connections_on_one_worker_thread() -> None:
    """Its workers only open connections, and each is a thread for the relay's life:
    the library's default three were two threads of 1,000 subscribers' relay for
    nothing (#53). Nothing listens at the address: the pool retries in the background."""
    pool = RelayPool(
        "postgresql://u@127.0.0.1:1/d", max_size=4, keep_free=0, name="pool-under-test"
    )
    try:
        workers = [t for t in threading.enumerate() if t.name.startswith("pool-under-test-worker")]
        assert len(workers) == 1
    finally:
        pool.close(timeout=1)
