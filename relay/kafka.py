"""The Kafka side: publishing a batch of records and waiting for every acknowledgement."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.errors import BrokerError, BrokerUnavailable, EncodingError
from relay.model import KafkaRecord, Position

logger = logging.getLogger(__name__)

# Delivery errors that are the record's fault, not the broker's: a poison event.
_RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)


class Publisher(Protocol):
    """Publishes one batch; returns only once the broker acknowledged every record."""

    def publish(self, records: Sequence[KafkaRecord], end: Position) -> None:
        """Raise :class:`BrokerUnavailable` (retry the batch) or :class:`EncodingError`."""

    def close(self) -> None: ...


class PoisonRecordError(EncodingError):
    """The broker rejected one record for what it is (too large, invalid topic...)."""

    def __init__(self, topic: str, error: KafkaError) -> None:
        self.topic = topic
        self.kafka_error = error
        super().__init__(f"broker rejected a record for topic {topic!r}: {error.str()}")


def producer_config(
    bootstrap_servers: str, overrides: Mapping[str, Any], delivery_timeout_ms: int
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers,
        "linger.ms": 5,
        # Same key → partition mapping as the Java client (and so Kafka Connect/Debezium).
        "partitioner": "murmur2_random",
        "message.timeout.ms": delivery_timeout_ms,
        **overrides,
    }
    # Not negotiable: without these, retries may reorder or duplicate within a key.
    config.update({"enable.idempotence": True, "acks": "all"})
    return config


class KafkaPublisher:
    """Idempotent-producer publishing (at-least-once across restarts, ordered per key)."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        config: Mapping[str, Any] | None = None,
        delivery_timeout_s: float = 30.0,
        create_topics: bool = True,
        topic_partitions: int = 3,
        topic_replication_factor: int = -1,
    ) -> None:
        self._config = producer_config(
            bootstrap_servers, config or {}, int(delivery_timeout_s * 1000)
        )
        # The admin client needs the same connection settings (TLS, SASL...) as the producer.
        self._admin_config = {**(config or {}), "bootstrap.servers": bootstrap_servers}
        self._delivery_timeout_s = delivery_timeout_s
        self._create_topics = create_topics
        self._partitions = topic_partitions
        self._replication = topic_replication_factor
        self._known_topics: set[str] = set()
        self._producer = self._new_producer()

    def _new_producer(self) -> Producer:
        try:
            return Producer(self._config, logger=logger)
        except KafkaException as exc:
            raise BrokerError(f"invalid Kafka producer configuration: {exc}") from exc

    def publish(self, records: Sequence[KafkaRecord], end: Position) -> None:
        if not records:
            return
        self._ensure_topics({r.topic for r in records})
        failures: list[tuple[str, KafkaError]] = []

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failures.append((msg.topic() or "?", err))

        for record in records:
            self._produce(record, delivered)
        self._wait()
        if failures:
            self._raise_for(failures)

    def _produce(self, record: KafkaRecord, callback: Any) -> None:
        while True:
            try:
                self._producer.produce(
                    record.topic,
                    record.value,
                    record.key,
                    headers=record.headers,
                    on_delivery=callback,
                )
                return
            except BufferError:
                self._producer.poll(0.05)  # local queue full: let deliveries drain
            except KafkaException as exc:
                raise BrokerError(f"cannot produce to {record.topic!r}: {exc}") from exc

    def _wait(self) -> None:
        # One producer per worker, so the producer's queue is exactly this batch.
        # message.timeout.ms bounds every record, so each gets a delivery report; the
        # deadline only protects against a wedged client.
        deadline = time.monotonic() + self._delivery_timeout_s * 2 + 10
        while (remaining := self._producer.flush(1.0)) > 0:
            if time.monotonic() > deadline:
                self._reset()
                raise BrokerUnavailable(
                    f"{remaining} records unacknowledged after the delivery timeout"
                )

    def _raise_for(self, failures: list[tuple[str, KafkaError]]) -> None:
        topic, error = failures[0]
        if error.code() in _RECORD_ERRORS:
            raise PoisonRecordError(topic, error)
        if error.fatal():
            # A fatal idempotence error leaves the producer unusable: start a new one.
            self._reset()
        raise BrokerUnavailable(f"{len(failures)} records not acknowledged: {error.str()}")

    def _reset(self) -> None:
        logger.warning("recreating the Kafka producer")
        self._producer.flush(0)
        self._producer = self._new_producer()

    def _ensure_topics(self, topics: set[str]) -> None:
        missing = topics - self._known_topics
        if not missing or not self._create_topics:
            self._known_topics |= missing
            return
        admin = AdminClient(self._admin_config)
        futures = admin.create_topics(
            [
                NewTopic(t, num_partitions=self._partitions, replication_factor=self._replication)
                for t in missing
            ],
            operation_timeout=10,
            request_timeout=15,
        )
        for topic, future in futures.items():
            try:
                future.result()
                logger.info("created topic %s", topic, extra={"topic": topic})
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if (
                    isinstance(error, KafkaError)
                    and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
                ):
                    continue
                if (
                    isinstance(error, KafkaError)
                    and not error.retriable()
                    and error.code() != KafkaError._TIMED_OUT
                ):
                    raise BrokerError(f"cannot create topic {topic!r}: {error.str()}") from exc
                raise BrokerUnavailable(f"cannot create topic {topic!r}: {exc}") from exc
        self._known_topics |= missing

    def close(self) -> None:
        remaining = self._producer.flush(self._delivery_timeout_s)
        if remaining:
            logger.warning("closing with %s records unacknowledged", remaining)
