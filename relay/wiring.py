"""The composition root: the one module that names the concrete adapters the relay's
ports are built of (Postgres for the store, the topic record and the pool; Kafka for
the publishers, the topic readers and the partitioner tracing asks), for the daemon,
the CLI and the local stack.

Everything below it -- the engine, ``ops``, the daemon's logic, ``/metrics`` -- takes
ports (``relay.core.ports``) or factories of ports, and so can be run over the
in-memory adapters (``relay.adapters.memory``); the tests hold each real adapter to the
same contract (``tests/contracts/``). To run the relay over another database or broker,
this is the module to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from relay.adapters.kafka.kafka import TopicCreator
from relay.adapters.kafka.partitioner import KeyPartitioner
from relay.adapters.kafka.publishers import PublisherFactory
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.postgres import db
from relay.adapters.postgres.dead_letters import DeadLetterStore
from relay.adapters.postgres.pool import RelayPool
from relay.adapters.postgres.probe import CommitProbe, Waiters, Wake
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.adapters.postgres.verify_queries import PostgresVerifyOutbox
from relay.adapters.registry.registry_format import client_for
from relay.adapters.registry.writer_lookup import RegistryWriters
from relay.core.ports import PartStore, StatusStore, TopicReader, TopicRecord, VerifyOutbox
from relay.core.settings import Settings
from relay.core.subscribers import TopicGuard
from relay.core.value_decoding import WriterById

Connect = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


def store_on(conn: psycopg.Connection[Any], schema: str = "public") -> OutboxStore:
    """The outbox's store on one connection the caller holds (a command's, a test's)."""
    return OutboxStore(conn, schema)


def dead_letter_store(conn: psycopg.Connection[Any], schema: str = "public") -> DeadLetterStore:
    """The dead letters' queries and a redrive's bookkeeping on one connection."""
    return DeadLetterStore(conn, schema)


def verify_outbox(conn: psycopg.Connection[Any], schema: str = "public") -> VerifyOutbox:
    """What verify reads of the outbox and its replays, on one connection."""
    return PostgresVerifyOutbox(conn, schema)


def daemon_store(settings: Settings) -> StatusStore:
    """A store on a connection of its own, with the daemon's session timeouts (the
    /metrics of a relay of several processes); closing it closes the connection."""
    return OutboxStore(connect_daemon(settings), settings.database_schema)


def session_timeouts(settings: Settings) -> db.SessionTimeouts:
    """The session timeouts of every connection of the relay daemon."""
    return db.SessionTimeouts(
        settings.database_statement_timeout,
        settings.database_lock_timeout,
        settings.database_idle_in_transaction_timeout,
    )


def connect_daemon(settings: Settings) -> psycopg.Connection[Any]:
    """A connection of the relay daemon outside its pool (the /metrics of a relay of
    several processes), with the session timeouts of ``settings``."""
    return db.connect(
        settings.require_database_url(),
        application_name="outbox-relay",
        timeouts=session_timeouts(settings),
    )


def relay_pool(settings: Settings, on_connect: Callable[[PartStore], None]) -> RelayPool:
    """The relay process's connections; ``on_connect`` sees each new one as a store."""
    return RelayPool(
        settings.require_database_url(),
        max_size=settings.max_db_connections,
        keep_free=settings.keep_free_connections,
        schema=settings.database_schema,
        on_connect=on_connect,
        timeouts=session_timeouts(settings),
    )


def commit_probe(pool: RelayPool, settings: Settings, wake: Wake, waiters: Waiters) -> CommitProbe:
    """The thread that wakes the parts' workers when new rows commit."""
    return CommitProbe(
        pool.connection,
        settings.database_schema,
        wake,
        interval=settings.probe_interval,
        idle_interval=settings.probe_idle_interval,
        waiters=waiters,
    )


def topic_record(connect: Connect, schema: str) -> TopicRecord:
    """The outbox's record of the topics it created (issue #47), on ``connect``'s
    connections."""
    return PostgresTopicRecord(connect, schema)


def publishers(settings: Settings, guard: TopicGuard, record: TopicRecord) -> PublisherFactory:
    """A part's publisher as the delivery setting asks, creating topics as ``record``
    allows."""
    return PublisherFactory(settings, guard, record)


def topic_creator(settings: Settings, record: TopicRecord) -> TopicCreator:
    """Creates topics as the relay does (its partitions and replication), recording
    them in ``record``."""
    return TopicCreator(
        {"bootstrap.servers": settings.require_bootstrap_servers()},
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
        record=record,
    )


def topic_reader(config: Mapping[str, Any], group: str) -> TopicReader:
    """Reads topics back (``read_committed``), as consumers would."""
    return KafkaTopicReader(config, group=group)


def writer_lookup(settings: Settings) -> WriterById | None:
    """The writer schemas of the configured schema registry, by id (None: no registry),
    as a reader of the Confluent wire format looks them up."""
    client = client_for(settings)
    return None if client is None else RegistryWriters(client)


def key_partitioner(settings: Settings) -> KeyPartitioner:
    """Where Kafka's producer puts a keyed record, for tracing's spans; close it at
    stop."""
    return KeyPartitioner.from_settings(settings)
