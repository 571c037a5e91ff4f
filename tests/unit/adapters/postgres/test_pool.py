"""The relay's connection pool (relay/adapters/postgres/pool.py), without a server: what borrows, and
how often a refusal is told."""

from __future__ import annotations

import logging

import pytest

from relay.adapters.postgres.db import Refusal
from relay.adapters.postgres.pool import PooledStore, _Refusals
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
