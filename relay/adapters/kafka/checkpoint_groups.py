"""The Kafka-side checkpoints' consumer groups: their committed offsets, and the group
metadata a transaction commits them with.

A part's transactional producers commit its checkpoint as the offsets of a group of its
own (named after the part and the checkpoint generation), in the transaction that
publishes its batch, and the part reads them back when it is opened. Each read is a
consumer of the group: a client of four threads and its connections, for the read only.
Both producers of a part share one read and the group's metadata, and the metadata needs
no broker: a consumer per producer for each, at every opening, took a relay of 1,000
subscribers past 150 threads (#53).

Why not the admin client's ``list_consumer_group_offsets``, which would need no consumer:
librdkafka (2.16) crashes the process when the broker answers it NOT_COORDINATOR, as a
group's coordinator does while it moves or loads (confluentinc/librdkafka#5040; seen
here on a fresh broker).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from relay.adapters.kafka.admin import connection_config
from relay.adapters.kafka.client_logs import client_logger
from relay.adapters.kafka.kafka_errors import Stage, classify, retry_now
from relay.errors import BrokerUnavailable, GroupRefused, RelayError

_client_log = client_logger()

# The checkpoint topic's two partitions: the transaction id's offset and the position's.
CHECKPOINT_PARTITIONS = 2

# How long the relay asks the broker why a group's offsets could not be read.
_DIAGNOSIS_TIMEOUT_S = 2.0

# At most this many reads hold a consumer at once: when many parts start together (a
# relay's first minute, or 1,000 parts taking turns on its producers), a consumer per
# part recovering was up to 8 clients of 4 threads at once beside the producers' (#53).
# A read takes tens of milliseconds, so the others wait little.
_READERS = 2
# How long a read waits for one of them before it reads anyway. A read can take up to
# its timeout (a group the broker refuses is only known then), and no part's recovery
# may wait on another's for that long: the bound gives way rather than stall a part.
_READER_WAIT_S = 1.0

# Group metadata kept; past this many groups the cache starts over (each made again in
# about a millisecond, without the network), so memory stays flat in subscribers.
_MAX_METADATA = 10_000


class CheckpointGroups:
    """The checkpoint groups of a relay's parts, read with ``consumer_config`` (the
    relay's Kafka settings and brokers). Safe to use from every part's thread at once."""

    def __init__(self, consumer_config: Mapping[str, Any]) -> None:
        self._config = dict(consumer_config)
        self._metadata: dict[str, Any] = {}
        self._making = threading.Lock()
        self._readers = threading.BoundedSemaphore(_READERS)

    def committed(self, group: str, topic: str, timeout_s: float) -> list[TopicPartition]:
        """``group``'s committed offsets of the checkpoint ``topic``'s partitions, stable
        ones only (a commit pending in an open transaction is waited for). When they
        cannot be read because the broker refuses the group, an error that says so."""
        wanted = [TopicPartition(topic, p) for p in range(CHECKPOINT_PARTITIONS)]
        reading = self._readers.acquire(timeout=_READER_WAIT_S)
        try:
            return self._read(group, wanted, timeout_s)
        finally:
            if reading:
                self._readers.release()

    def _read(
        self, group: str, wanted: list[TopicPartition], timeout_s: float
    ) -> list[TopicPartition]:
        consumer = self._consumer(group)
        try:
            return read_committed(consumer, wanted, timeout_s)
        except BrokerUnavailable as exc:
            # Only a timeout can hide a refused group; a broker that is away answers no
            # describe either, and the diagnosis is bounded so as not to delay the retry.
            if exc.code != KafkaError._TIMED_OUT:
                raise
            refused = group_refusal(self._config, group, _DIAGNOSIS_TIMEOUT_S)
            if refused is None:
                raise
            try:
                raise refused from exc
            finally:
                del refused  # see read_committed
        finally:
            consumer.close()

    def metadata(self, group: str) -> Any:
        """The metadata that commits ``group``'s offsets in a transaction
        (``send_offsets_to_transaction``): the group's name as librdkafka encodes it for
        a member that never joins, which the relay's never do. Only a consumer makes it,
        so one without brokers (its threads reach no network; about a millisecond) is made
        once per group, one at a time, and closed."""
        found = self._metadata.get(group)
        if found is not None:
            return found
        with self._making:
            if len(self._metadata) >= _MAX_METADATA:
                self._metadata.clear()
            consumer = Consumer({"group.id": group}, logger=_client_log)
            try:
                found = self._metadata[group] = consumer.consumer_group_metadata()
            finally:
                consumer.close()
        return found

    def _consumer(self, group: str) -> Consumer:
        config = {
            **self._config,
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
        try:
            return Consumer(config, logger=_client_log)
        except KafkaException as exc:
            raise classify(exc, "kafka: invalid consumer configuration", Stage.CONFIGURE) from exc


def read_committed(
    consumer: Consumer, wanted: list[TopicPartition], timeout_s: float
) -> list[TopicPartition]:
    """The group's committed offsets of ``wanted``. A coordinator being found or loaded
    (a fresh cluster's first group, a broker restarted) is asked again until
    ``timeout_s``: it answers within seconds, and failing on it made a command's first
    run on a new cluster fail (redrive: "Not coordinator")."""
    # The topic named: a checkpoint topic that is missing, or refused by an ACL, says so.
    context = f"cannot read the Kafka-side checkpoint (topic {wanted[0].topic!r})"
    deadline = time.monotonic() + timeout_s
    failure: RelayError | None = None
    try:
        while True:
            try:
                committed = consumer.committed(wanted, timeout=timeout_s)
            except KafkaException as exc:
                failure = classify(exc, context, Stage.GROUP_OFFSETS)
                if not retry_now(failure) or time.monotonic() > deadline:
                    raise failure from exc
            else:
                failed = next((tp.error for tp in committed if tp.error is not None), None)
                if failed is None:
                    return list(committed)
                failure = classify(failed, context, Stage.GROUP_OFFSETS)
                if not retry_now(failure) or time.monotonic() > deadline:
                    raise failure
            time.sleep(0.2)
    finally:
        # Raised, the failure's traceback holds this frame, which holds the failure: a
        # cycle that kept the caller (a part's publisher, its clients' threads) until the
        # cyclic collector, rare in a relay (#53).
        failure = None


def group_refusal(config: Mapping[str, Any], group: str, timeout_s: float) -> GroupRefused | None:
    """The broker's refusal of ``group`` to this principal, when that is why its offsets
    could not be read. The consumer meets GROUP_AUTHORIZATION_FAILED only while looking for
    the group's coordinator, which librdkafka asks again, reporting nothing, until
    ``committed()`` times out; an admin client's describe of the group is refused at once."""
    admin = AdminClient(connection_config(dict(config)))
    context = f"cannot read the Kafka-side checkpoint of group {group!r}"
    try:
        admin.describe_consumer_groups([group], request_timeout=timeout_s)[group].result(timeout_s)
    except KafkaException as exc:
        failure = classify(exc, context, Stage.GROUP_OFFSETS)
        return failure if isinstance(failure, GroupRefused) else None
    except TimeoutError:  # a diagnosis only: the read's own error stands
        return None
    return None
