"""outbox-relay on the test servers: the Avro schemas, a migrated database (``db``),
the roles production runs as (``relay_url``, ``writer_url``, ``writer_db``,
``second_writer_url``, ``stranger_url``, ``relay_db``), the write API (``outbox``) and in-process relays (``start_relay``,
as the relay role)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.adapters.postgres import migrations
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.write.outbox import Outbox
from tests.support import SECOND_WRITER_ROLE, Roles, grant_test_roles, grant_writer

# -- outbox-relay fixtures ---------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def registry() -> SchemaFolder:
    return SchemaFolder.from_dir(REPO / "schemas")


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to a fresh, migrated database, as its owner (who
    migrates and grants; tests/README.md says who else does what)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn)
        yield conn


@pytest.fixture
def roles(db: psycopg.Connection[Any], database_url: str) -> Roles:
    """The migrated database's URLs as each role, granted by `outbox-relay grant`."""
    return grant_test_roles(database_url)


@pytest.fixture
def relay_reads_all_stats(roles: Roles) -> None:
    """`grant --read-all-stats`: the relay role may name the sessions holding the
    publication horizon (tests of the horizon diagnostics ask for it)."""
    grant_test_roles(roles.owner_url, read_all_stats=True)


@pytest.fixture
def relay_url(roles: Roles) -> str:
    """The migrated database as the relay role (`grant --relay-role`)."""
    return roles.relay_url


@pytest.fixture
def writer_url(roles: Roles) -> str:
    """The migrated database as the writer role (`grant --writer-role`)."""
    return roles.writer_url


@pytest.fixture
def second_writer_url(roles: Roles) -> str:
    """The migrated database as a second writer role (`grant --writer-role` again):
    another application, for what one writer can and cannot do to another's events."""
    return grant_writer(roles.owner_url, SECOND_WRITER_ROLE)


@pytest.fixture
def stranger_url(roles: Roles) -> str:
    """The migrated database as a login role with no grant at all."""
    return roles.stranger_url


@pytest.fixture
def writer_db(writer_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection as the writer role: where tests write their events."""
    with psycopg.connect(writer_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def relay_db(relay_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection as the relay role: for tests that play a relay's part
    (a store's sessions, claims and checkpoints) or run the `subscribers` commands."""
    with psycopg.connect(relay_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def outbox(registry: SchemaFolder) -> Outbox:
    return Outbox(registry)


@pytest.fixture
def start_relay(
    relay_url: str, kafka_bootstrap: str, registry: SchemaFolder
) -> Iterator[Callable[..., Relay]]:
    """Start an in-process relay on the test database as the relay role (on the session's
    broker unless ``bootstrap_servers`` says otherwise); stopped at teardown."""
    started: list[Relay] = []

    def start(**settings: Any) -> Relay:
        settings.setdefault("poll_interval", 0.2)
        # Fast rebalancing, so claims (and takeovers) happen within a second in tests.
        settings.setdefault("heartbeat_interval", 0.3)
        settings.setdefault("session_timeout", 3.0)
        settings.setdefault("metrics_port", 0)  # several relays share this host: any free port
        settings.setdefault("bootstrap_servers", kafka_bootstrap)
        relay = Relay(load_settings(database_url=relay_url, **settings), registry=registry)
        relay.start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()
