"""outbox-relay on the test servers: the Avro schemas, a migrated database (``db``),
the write API (``outbox``) and in-process relays (``start_relay``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay import migrations
from relay.daemon import Relay
from relay.outbox import Outbox
from relay.schemas import SchemaFolder
from relay.settings import load_settings

# -- outbox-relay fixtures ---------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def registry() -> SchemaFolder:
    return SchemaFolder.from_dir(REPO / "schemas")


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to a fresh, migrated database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn)
        yield conn


@pytest.fixture
def outbox(registry: SchemaFolder) -> Outbox:
    return Outbox(registry)


@pytest.fixture
def start_relay(
    db: psycopg.Connection[Any], database_url: str, kafka_bootstrap: str, registry: SchemaFolder
) -> Iterator[Callable[..., Relay]]:
    """Start an in-process relay on the test database; stopped at teardown."""
    started: list[Relay] = []

    def start(**settings: Any) -> Relay:
        settings.setdefault("poll_interval", 0.2)
        # Fast rebalancing, so claims (and takeovers) happen within a second in tests.
        settings.setdefault("heartbeat_interval", 0.3)
        settings.setdefault("session_timeout", 3.0)
        settings.setdefault("metrics_port", 0)  # several relays share this host: any free port
        relay = Relay(
            load_settings(database_url=database_url, bootstrap_servers=kafka_bootstrap, **settings),
            registry=registry,
        )
        relay.start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()
