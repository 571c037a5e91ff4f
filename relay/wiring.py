"""The composition root: the one module that names the concrete adapters the relay's
ports are built of (Postgres for the store, the topic record and the pool; Kafka for
the publishers, the topic readers and the partitioner tracing asks; the readers of
the consumers' sinks), for the daemon, the CLI and the local stack.

Everything below it -- the engine, ``ops``, the daemon's logic, ``/metrics`` -- takes
ports (``relay.core.ports``) or factories of ports, and so can be run over the
in-memory adapters (``relay.adapters.memory``); the tests hold each real adapter to the
same contract (``tests/contracts/``). To run the relay over another database or broker,
this is the module to change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from relay.adapters.kafka.admin import SharedAdmin
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups
from relay.adapters.kafka.kafka import (
    TopicCreator,
    TransactionalPublisher,
    producer_config,
    transaction_timeout,
)
from relay.adapters.kafka.partitioner import KeyPartitioner
from relay.adapters.kafka.publishers import PublisherFactory, routed_topic_creator
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.kafka.topics import partition_room_refusal
from relay.adapters.postgres import db
from relay.adapters.postgres.dead_letters import DeadLetterStore
from relay.adapters.postgres.pool import RelayPool
from relay.adapters.postgres.probe import CommitProbe, Waiters, Wake
from relay.adapters.postgres.projection import OrderProjection
from relay.adapters.postgres.replay_store import ReplayStore
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.adapters.postgres.verify_queries import PostgresVerifyOutbox
from relay.adapters.registry.registry_compat import CompatibilityReport, check_subscriber
from relay.adapters.registry.registry_format import RegistryValueEncoder, client_for, encoder_for
from relay.adapters.registry.writer_lookup import RegistryWriters
from relay.adapters.sinks.archive import ArchiveReader
from relay.adapters.sinks.delta import DeltaReader
from relay.core.ports import (
    PartStore,
    ProjectionReader,
    Publisher,
    ReplayLedger,
    SinkReader,
    StatusStore,
    TopicReader,
    TopicRecord,
    VerifyOutbox,
)
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, TopicGuard
from relay.core.value_decoding import WriterById
from relay.errors import ConfigError

Connect = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
# The store the CLI hands the ops commands that use most of it, the ledger too, as
# their ports (relay.ops.interventions, relay.ops.subscribers: InterventionStore,
# DefinitionStore): named here, so the CLI need not.
Store = OutboxStore


def connect(
    settings: Settings, application_name: str = "outbox-relay-cli"
) -> psycopg.Connection[Any]:
    """A command's own (autocommit) connection to the configured database."""
    return db.connect(settings.require_database_url(), application_name=application_name)


def store_on(conn: psycopg.Connection[Any], schema: str = "public") -> Store:
    """The outbox's store on one connection the caller holds (a command's, a test's)."""
    return OutboxStore(conn, schema)


def dead_letter_store(conn: psycopg.Connection[Any], schema: str = "public") -> DeadLetterStore:
    """The dead letters' queries and a redrive's bookkeeping on one connection."""
    return DeadLetterStore(conn, schema)


def verify_outbox(conn: psycopg.Connection[Any], schema: str = "public") -> VerifyOutbox:
    """What verify reads of the outbox and its replays, on one connection."""
    return PostgresVerifyOutbox(conn, schema)


def replay_ledger(conn: psycopg.Connection[Any], schema: str = "public") -> ReplayLedger:
    """A replay's range and the replays on the ledger, on one autocommit connection."""
    return ReplayStore(conn, schema)


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


def publishers(
    settings: Settings, guard: TopicGuard, record: TopicRecord, admin: SharedAdmin
) -> PublisherFactory:
    """A part's publisher as the delivery setting asks, creating topics as ``record``
    allows, with the relay's ``admin`` client."""
    return PublisherFactory(settings, guard, record, admin)


def shared_admin(settings: Settings) -> SharedAdmin:
    """The relay's one admin client: its broker watch, topic creation and replication
    check share it (relay/adapters/kafka/admin.py)."""
    return SharedAdmin(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
    )


def exactly_once_publisher(
    settings: Settings, prefix: str, guard: TopicGuard, record: TopicRecord | None, command: str
) -> Publisher:
    """A transactional publisher of an operator's ``command`` (redrive, replay): its
    ``transactional.id`` and checkpoint group are ``prefix`` (plus the generation).
    ``guard`` (with the subscribers loaded) and ``record`` (the outbox's record of its
    topics) confine the topics rows chose, and count the new ones towards
    ``max_created_topics``, as in the relay (the same constructor)."""
    if settings.delivery != "transactional":
        raise ConfigError(
            f"delivery: {command} publishes exactly once through Kafka transactions, which "
            f"delivery = {settings.delivery!r} says this broker does not offer"
        )
    bootstrap = settings.require_bootstrap_servers()
    client = {**settings.kafka, "bootstrap.servers": bootstrap}
    topics = routed_topic_creator(settings, guard, record)
    return TransactionalPublisher(
        producer_config(bootstrap, settings.kafka, int(settings.delivery_timeout * 1000)),
        topics,
        settings.delivery_timeout,
        transactional_id=prefix,
        transaction_timeout_s=transaction_timeout(settings.session_timeout),
        group_prefix=prefix,
        checkpoint_topic=settings.checkpoint_topic,
        groups=CheckpointGroups(client),
    )


def topic_creator(settings: Settings, record: TopicRecord) -> TopicCreator:
    """Creates topics as the relay does (its partitions and replication), recording
    them in ``record``."""
    return TopicCreator(
        {"bootstrap.servers": settings.require_bootstrap_servers()},
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
        record=record,
    )


def topic_reader(
    config: Mapping[str, Any], group: str = "outbox-relay-verify", timeout: float = 120.0
) -> TopicReader:
    """Reads topics back (``read_committed``), as consumers would; ``timeout``: seconds
    a topic may take to be read to its end."""
    return KafkaTopicReader(config, group=group, timeout=timeout)


# The sinks ``verify --through NAME PATH`` reads, by name: another sink is one module of
# relay/adapters/sinks/ (a projection's: of its database's adapters) and one line here.
# A sink of events gives their ids (SinkReader); a projection, its rows per key.
SINK_READERS: dict[str, Callable[[str], SinkReader | ProjectionReader]] = {
    "archive": ArchiveReader,
    "delta": DeltaReader,
    "projection": OrderProjection,
}


def sink_reader(name: str, path: str) -> SinkReader | ProjectionReader:
    """The reader of the sink ``name`` at ``path``."""
    if name not in SINK_READERS:
        raise ConfigError(f"no sink named {name!r}: one of {', '.join(sorted(SINK_READERS))}")
    return SINK_READERS[name](path)


def writer_lookup(settings: Settings) -> WriterById | None:
    """The writer schemas of the configured schema registry, by id (None: no registry),
    as a reader of the Confluent wire format looks them up."""
    client = client_for(settings)
    return None if client is None else RegistryWriters(client)


def registry_encoder(
    settings: Settings, schemas: SchemaFolder | None
) -> RegistryValueEncoder | None:
    """The avro-registry encoder of the configured schema registry (None: no
    schema_registry_url), over the writer schemas loaded."""
    return encoder_for(settings, schemas)


def registry_check(
    encoder: RegistryValueEncoder | None,
) -> Callable[[SchemaFolder, Subscriber], CompatibilityReport] | None:
    """A subscriber's writer schemas checked against the compatibility rules of
    ``encoder``'s registry (None: no registry), for the checks of a definition
    (relay.ops.subscribers.Setup)."""
    return None if encoder is None else functools.partial(check_subscriber, encoder.client)


def partition_room(settings: Settings, subscribers: Sequence[Subscriber]) -> tuple[str, str] | None:
    """The first of ``subscribers`` whose topics lack partitions its partition field
    ranges over, and why, as the broker says (relay.ops.subscribers.Setup)."""
    return partition_room_refusal(settings, subscribers)


def key_partitioner(settings: Settings) -> KeyPartitioner:
    """Where Kafka's producer puts a keyed record, for tracing's spans; close it at
    stop."""
    return KeyPartitioner.from_settings(settings)
