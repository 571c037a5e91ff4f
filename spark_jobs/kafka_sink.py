"""An exactly-once Kafka sink for ``foreachBatch``: one transaction per micro-batch.

Each micro-batch's records are produced in one Kafka transaction, and the same
transaction records the batch id: it commits offset ``batch_id + 1`` for partition 0 of
the output topic under a consumer group of the sink and the streaming query
(``spark-sink.<sink>.<query id>``, with ``send_offsets_to_transaction``, the mechanism
Kafka's consume-transform-produce loops use). Records and marker become
visible together or not at all, so:

* a replayed batch (Spark runs it again after a driver crash) finds its id committed
  and writes nothing;
* a driver that died inside a transaction left it open: the next driver's
  ``init_transactions`` under the same ``transactional.id`` aborts it (and fences the
  dead driver, should it come back), so read_committed consumers never see its records.

The group's "offset" is a batch marker, not a position in the topic: no consumer reads
with that group. Batch ids only mean something within one streaming query, and the query
id (kept in the checkpoint's ``metadata``) is in the group's name: a query started from a
new checkpoint has no marker, so it writes its batches instead of skipping them on
another query's marker. The sink name names the transactional id, so drivers of the
same sink fence each other whatever their query.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.adapters.kafka.kafka_errors import Stage, classify, retry_now
from relay.core.log_fields import log_extra
from relay.core.settings import KafkaValue
from relay.errors import RelayError
from spark_jobs.kafka_clients import KafkaClients, connection_settings

logger = logging.getLogger(__name__)

Record = tuple[bytes | None, bytes]  # key, value

_TIMEOUT_S = 60.0


class KafkaSinkError(RelayError):
    """The Kafka sink could not commit a micro-batch."""


class OutputTopicMissingError(KafkaSinkError):
    """The sink's topic does not exist, and the job was told not to create it."""


def ensure_topic(clients: KafkaClients, topic: str, *, create: bool, flag: str) -> None:
    """Create ``topic`` (the broker's default partitions and replication) unless it
    exists. With ``create`` off, a missing topic fails here, in one line that says how to
    create it, not at the first batch in a 150-line trace. ``flag`` turns creation off."""
    admin = AdminClient(clients.librdkafka())
    try:
        if topic in admin.list_topics(timeout=_TIMEOUT_S).topics:
            return
        if not create:
            raise OutputTopicMissingError(
                f"output topic {topic!r} does not exist: create it (kafka-topics.sh "
                f"--bootstrap-server {clients.bootstrap_servers} --create --topic {topic}), "
                f"or run without {flag} to let the job create it"
            )
        future = admin.create_topics([NewTopic(topic, -1, -1)])[topic]
        future.result(_TIMEOUT_S)
        logger.info(
            "created the output topic %s",
            topic,
            extra=log_extra("spark_sink_topic_created", topic=topic),
        )
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" in str(exc):  # created meanwhile: what we wanted
            return
        raise KafkaSinkError(f"output topic {topic!r}: cannot check or create it: {exc}") from exc


class KafkaBatchSink:
    """Commits a micro-batch's records to ``topic`` exactly once (see module doc)."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        sink: str,
        kafka_settings: Mapping[str, KafkaValue] | None = None,
    ) -> None:
        self.topic = topic
        self.sink = sink
        # TLS/SASL: the relay's connection settings (librdkafka names, like ours).
        self._clients = KafkaClients(bootstrap_servers, connection_settings(kafka_settings or {}))
        self._marker = TopicPartition(topic, 0)
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._consumer_group = ""

    def group(self, query_id: str) -> str:
        """The consumer group whose committed offset is the query's next batch id."""
        return f"spark-sink.{self.sink}.{query_id}"

    def commit(self, batch_id: int, records: Sequence[Record], query_id: str) -> bool:
        """Produce ``records`` and mark ``batch_id`` of query ``query_id``, in one
        transaction; False if the batch was already committed (a replay), in which case
        nothing is written."""
        producer = self._ready_producer()
        done = self.committed_batches(query_id)
        if batch_id < done:
            logger.info(
                "sink %s: batch %s already written, skipping",
                self.sink,
                batch_id,
                extra=log_extra("spark_sink_batch_skipped", sink=self.sink, batch_id=batch_id),
            )
            return False
        try:
            producer.begin_transaction()
            for key, value in records:
                self._produce(producer, key, value)
            marker = TopicPartition(self.topic, 0, batch_id + 1)
            metadata = self._group_consumer(query_id).consumer_group_metadata()
            producer.send_offsets_to_transaction([marker], metadata, _TIMEOUT_S)
            producer.commit_transaction(_TIMEOUT_S)
        except KafkaException as exc:
            self._abandon(producer)
            raise KafkaSinkError(
                f"sink {self.sink}: batch {batch_id} not committed: {exc}"
            ) from exc
        return True

    def committed_batches(self, query_id: str) -> int:
        """How many batches (ids 0..n-1) of the query are committed: its marker, or 0."""
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            try:
                consumer = self._group_consumer(query_id)
                [marker] = consumer.committed([self._marker], timeout=_TIMEOUT_S)
                break
            except KafkaException as exc:
                # The group's coordinator is being found or loaded, or a commit of the
                # marker is still pending: all pass; anything else is an answer.
                context = f"sink {self.sink}: cannot read its marker"
                failure = classify(exc, context, Stage.GROUP_OFFSETS)
                if not retry_now(failure) or time.monotonic() > deadline:
                    raise KafkaSinkError(str(failure)) from exc
                time.sleep(0.2)
        if marker.error is not None:
            raise KafkaSinkError(f"sink {self.sink}: cannot read its batch marker: {marker.error}")
        return max(marker.offset, 0)  # a negative offset means none committed

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
        self._producer = self._consumer = None

    def _ready_producer(self) -> Producer:
        # init_transactions first: it aborts what a dead driver left open, so the marker
        # read next is final (read_committed offset fetches wait for pending commits).
        if self._producer is None:
            producer = Producer(
                self._clients.librdkafka(
                    {
                        "transactional.id": f"spark-sink.{self.sink}",
                        "enable.idempotence": True,
                        # With more in flight, a batch refused "not leader" can be
                        # counted delivered and dropped (docs/design.md §5).
                        "max.in.flight.requests.per.connection": 1,
                        "linger.ms": 5,
                    }
                )
            )
            producer.init_transactions(_TIMEOUT_S)
            self._producer = producer
        return self._producer

    def _group_consumer(self, query_id: str) -> Consumer:
        if self._consumer is not None and self._consumer_group != self.group(query_id):
            self._consumer.close()  # another query of the same sink (rare): its own group
            self._consumer = None
        if self._consumer is None:
            self._consumer_group = self.group(query_id)
            self._consumer = Consumer(
                self._clients.librdkafka(
                    {
                        "group.id": self._consumer_group,
                        "isolation.level": "read_committed",
                        "enable.auto.commit": False,
                    }
                )
            )
        return self._consumer

    def _produce(self, producer: Producer, key: bytes | None, value: bytes) -> None:
        while True:
            try:
                producer.produce(self.topic, value, key)
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)

    def _abandon(self, producer: Producer) -> None:
        # A fresh producer re-runs init_transactions, which aborts whatever is open.
        try:
            producer.abort_transaction(_TIMEOUT_S)
        except KafkaException:
            logger.warning(
                "sink %s: abort failed; a new producer will fence it",
                self.sink,
                extra=log_extra("spark_sink_abort_failed", sink=self.sink),
            )
        self._producer = None
