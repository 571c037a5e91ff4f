"""Listing and creating Kafka topics for operators (``outbox-relay topics``).

What ``kafka-topics.sh --list`` / ``--create`` do, through confluent-kafka's AdminClient
and the relay's own Kafka settings (TLS, SASL), so no Kafka distribution or JVM is
needed next to the relay.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.adapters.kafka.client_logs import client_logger
from relay.adapters.kafka.kafka_errors import Stage, classify
from relay.core.log_fields import log_extra
from relay.core.subscribers import Subscriber, partition_shortfall
from relay.errors import ConfigError

if TYPE_CHECKING:
    from relay.core.settings import Settings

logger = logging.getLogger(__name__)

_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
        }


def admin_client(config: Mapping[str, Any]) -> AdminClient:
    client: dict[str, Any] = {**config, "logger": client_logger()}
    try:
        return AdminClient(client)
    except KafkaException as exc:
        raise classify(exc, "kafka: invalid client configuration", Stage.CONFIGURE) from exc


def list_topics(admin: AdminClient, *, internal: bool = False) -> list[TopicInfo]:
    """The cluster's topics by name; internal ones (``__consumer_offsets``...) only when
    asked for."""
    try:
        metadata = admin.list_topics(timeout=_TIMEOUT_S)
    except KafkaException as exc:
        raise classify(exc, "cannot list topics") from exc
    topics = []
    for name, topic in metadata.topics.items():
        if name.startswith("__") and not internal:
            continue
        partitions = topic.partitions.values()
        replicas = max((len(p.replicas) for p in partitions), default=0)
        topics.append(TopicInfo(name, len(topic.partitions), replicas))
    return sorted(topics, key=lambda t: t.name)


def create_topics(
    admin: AdminClient,
    names: Sequence[str],
    *,
    partitions: int,
    replication_factor: int = -1,
    config: Mapping[str, str] | None = None,
) -> dict[str, bool]:
    """Create ``names``; returns each name with True when created, False when it existed.
    Raises for the first topic the broker refused (the others are created)."""
    new = [
        NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config=dict(config or {}),
        )
        for name in names
    ]
    try:
        futures = admin.create_topics(new, operation_timeout=_TIMEOUT_S, request_timeout=_TIMEOUT_S)
    except KafkaException as exc:  # the client refused the request's arguments
        raise classify(exc, "cannot create topics", Stage.CONFIGURE) from exc
    except ValueError as exc:
        raise ConfigError(f"cannot create topics: {exc}") from exc
    created: dict[str, bool] = {}
    failures = []
    for name, future in futures.items():
        try:
            future.result()
            created[name] = True
            logger.info(
                "created topic %s", name, extra=log_extra("kafka_topic_created", topic=name)
            )
        except KafkaException as exc:
            failure = classify(exc, name, Stage.CREATE_TOPIC)
            if failure is None:  # it exists already
                created[name] = False
            else:
                failures.append((failure, exc))
    if failures:
        failure, cause = failures[0]
        try:
            raise failure from cause
        finally:
            del failure, failures, cause  # raised, they hold this frame: no cycle
    return {name: created[name] for name in names}


def parse_config(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` topic settings (``cleanup.policy=compact``) as a mapping."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config {pair!r}: expected KEY=VALUE, e.g. retention.ms=86400000")
        parsed[key.strip()] = value
    return parsed


def partition_room_refusal(
    settings: Settings, subscribers: Sequence[Subscriber]
) -> tuple[str, str] | None:
    """The name of the first of ``subscribers`` with a partition field cannot have every partition it
    ranges over on its topics (the broker's counts for topics that exist, the relay's
    topic_partitions for those it is to create), and why; None when all can. Raises
    :class:`BrokerUnavailable` when the broker cannot say, and :class:`ConfigError`
    without bootstrap_servers."""
    wanting = [s for s in subscribers if s.partition_count is not None]
    if not wanting:
        return None
    admin = admin_client(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
    )
    counts = {t.name: t.partitions for t in list_topics(admin)}
    for subscriber in wanting:
        problem = partition_shortfall(
            subscriber,
            counts,
            create_topics=settings.create_topics,
            topic_partitions=settings.topic_partitions,
        )
        if problem is not None:
            return subscriber.name, problem
    return None
