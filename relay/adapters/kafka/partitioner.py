"""The partition Kafka's producer picks for a keyed record, read outside the producer.

The relay's tracing names the partition a record went to on its span; the producer
does not say before delivery, so it is computed here as the producer computes it: the
key's murmur2 hash (Java's client and librdkafka's ``murmur2_random``, which the relay's
producers use) modulo the topic's partition count, read from the cluster's metadata and
kept a while. :class:`KeyPartitioner` is the callable the tracing is handed
(``relay.observability.tracing.PartitionOf``): tracing itself never talks to Kafka.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relay.core.log_fields import log_extra

if TYPE_CHECKING:
    from relay.core.settings import Settings

logger = logging.getLogger(__name__)

# How long a topic's partition count is trusted (partitions can be added).
_PARTITIONS_TTL_S = 60.0


class PartitionCounts:
    """Partition counts of topics, read from the cluster's metadata and kept a while."""

    def __init__(self, admin_config: Mapping[str, Any]) -> None:
        self._config = dict(admin_config)
        self._admin: Any = None
        self._known: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, topic: str) -> int | None:
        known = self._known.get(topic)
        if known is not None and time.monotonic() - known[1] < _PARTITIONS_TTL_S:
            return known[0]
        with self._lock:
            count = self._read(topic)
        if count is not None:
            self._known[topic] = (count, time.monotonic())
        return count

    def close(self) -> None:
        """Drop the admin client (librdkafka's handle goes with it); a later lookup
        opens another."""
        with self._lock:
            self._admin = None

    def _read(self, topic: str) -> int | None:
        # Imported when first asked: a relay without tracing never loads it for this.
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        try:
            if self._admin is None:
                self._admin = AdminClient(self._config)
            metadata = self._admin.list_topics(topic=topic, timeout=5).topics.get(topic)
        except KafkaException as exc:
            logger.debug(
                "no partition count for %s: %s",
                topic,
                exc,
                extra=log_extra("tracing_partition_count_unknown", topic=topic, error=exc),
            )
            return None
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return None
        return len(metadata.partitions)


class KeyPartitioner:
    """``(topic, key) -> partition`` as the producer picks it, None while the topic's
    partition count is unknown."""

    def __init__(self, counts: Callable[[str], int | None]) -> None:
        self._counts = counts

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyPartitioner:
        admin = {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
        return cls(PartitionCounts(admin))

    def __call__(self, topic: str, key: bytes) -> int | None:
        count = self._counts(topic)
        if not count:
            return None
        return (murmur2(key) & 0x7FFFFFFF) % count

    def close(self) -> None:
        """Let go of the metadata client, if it holds one (at stop)."""
        if isinstance(self._counts, PartitionCounts):
            self._counts.close()


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (Java client's ``Utils.murmur2``, librdkafka's murmur2), as
    an unsigned 32-bit integer."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length // 4
    for word in struct.unpack_from(f"<{whole}I", data):
        k = (word * m) & 0xFFFFFFFF
        k ^= k >> 24
        h = ((h * m) & 0xFFFFFFFF) ^ ((k * m) & 0xFFFFFFFF)
    tail, rest = data[whole * 4 :], length % 4
    if rest == 3:
        h ^= tail[2] << 16
    if rest >= 2:
        h ^= tail[1] << 8
    if rest >= 1:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)
