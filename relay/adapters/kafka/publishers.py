"""The publisher factory: a Kafka publisher for a part, as the delivery setting asks (the
relay keeps at most max_producers open: relay/engine/scheduling.py)."""

from __future__ import annotations

from collections.abc import Callable

from confluent_kafka.admin import AdminClient

from relay.adapters.kafka.call_thread import CallThread
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups
from relay.adapters.kafka.kafka import (
    IdempotentPublisher,
    TopicCreator,
    TransactionalPublisher,
    producer_config,
    transaction_timeout,
)
from relay.adapters.kafka.turns import part_publisher
from relay.core.ports import PartState, Publisher, TopicRecord
from relay.core.settings import Settings
from relay.core.subscribers import TopicGuard


def routed_topic_creator(
    settings: Settings,
    guard: TopicGuard,
    record: TopicRecord | None,
    admin: Callable[[], AdminClient] | None = None,
) -> TopicCreator:
    """The topic creator for the topics records go to, as the settings, ``guard`` (the
    subscribers loaded) and ``record`` (the outbox's record of its topics) say: the
    operator's and the relay's own topics are created whatever the count, the rows'
    are confined and counted (issue #47). The relay and redrive both use this one;
    ``admin``: the relay's admin client, if it shares one (relay/adapters/kafka/admin.py)."""
    return TopicCreator(
        {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()},
        enabled=settings.create_topics,
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
        max_created=None if settings.max_created_topics < 0 else settings.max_created_topics,
        relay_owned=guard.relay_owned,
        record=record,
        allow_listed=guard.allow_listed,
        admin=admin,
    )


class PublisherFactory:
    """Opens a part's publisher; every publisher shares one topic creator, and the
    transactional ones where their checkpoints are read."""

    def __init__(
        self,
        settings: Settings,
        topic_guard: TopicGuard,
        record: TopicRecord | None,
        admin: Callable[[], AdminClient] | None = None,
    ) -> None:
        """``admin``: the relay's admin client, for creating topics (None: the topic
        creator's own)."""
        self._settings = settings
        self._bootstrap_servers = settings.require_bootstrap_servers()
        self._topics = routed_topic_creator(settings, topic_guard, record, admin)
        self._groups = CheckpointGroups(
            {**settings.kafka, "bootstrap.servers": self._bootstrap_servers}
        )

    def written_topics(self) -> frozenset[str]:
        """The topics this relay's parts have published to (their checkpoint topic too)."""
        return self._topics.known()

    def __call__(self, state: PartState) -> Publisher:
        s = self._settings
        config = producer_config(
            self._bootstrap_servers, s.kafka, int(s.delivery_timeout * 1000), delivery=s.delivery
        )
        if s.delivery == "idempotent":
            return IdempotentPublisher(config, self._topics, s.delivery_timeout)
        name = f"{s.kafka_id_prefix}.{state.name}.{state.part}"
        # One thread for both producers' transactional calls: a turn's commit returns
        # before the other's transaction begins, so they never overlap but at recovery,
        # which fences the second on a thread of its own. A thread each was 8 of 1,000
        # subscribers' relay (#53).
        calls = CallThread("kafka-txn-call")

        def open_producer(transactional_id: str) -> TransactionalPublisher:
            return TransactionalPublisher(
                config,
                self._topics,
                s.delivery_timeout,
                transactional_id=transactional_id,
                transaction_timeout_s=transaction_timeout(s.session_timeout),
                group_prefix=name,
                checkpoint_topic=s.checkpoint_topic,
                groups=self._groups,
                calls=calls,
            )

        return part_publisher(
            open_producer, f"{name}.{state.subscriber_id}", s.transaction_producers
        )
