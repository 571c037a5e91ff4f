"""Whether the relay's topics survive losing a broker: checked once, when Kafka first
answers, and warned about (issue #29; deploy/README.md, "Kafka brokers").

On a cluster of several brokers, a topic with one replica stops (or loses records) when
its broker does, and ``min.insync.replicas=1`` lets an acknowledged record live on one
broker only. Neither stops the relay from starting: the operator may have reasons (a
test cluster); the relay says which topics and what to change.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    ResourceType,
)

from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

# Topics looked at in detail (one DescribeConfigs request): the checkpoint topic and
# existing topics the subscribers route to, at most this many.
_MAX_TOPICS = 100
_TIMEOUT_S = 10.0


def relay_topics(templates: Iterable[str], checkpoint_topic: str) -> Callable[[str], bool]:
    """Whether a topic is the checkpoint topic or one a subscriber's template yields."""
    patterns = [_template_pattern(t) for t in templates]

    def relevant(topic: str) -> bool:
        return topic == checkpoint_topic or any(p.fullmatch(topic) for p in patterns)

    return relevant


def _template_pattern(template: str) -> re.Pattern[str]:
    pattern = ""
    for literal, name, _, _ in string.Formatter().parse(template):
        pattern += re.escape(literal) + ("[A-Za-z0-9._-]+" if name is not None else "")
    return re.compile(pattern)


def check_replication(
    admin: AdminClient, relevant: Callable[[str], bool], creates_with: int
) -> list[str]:
    """Warnings (also logged) about the relay's topics on a multi-broker cluster: a
    replication factor of 1, ``min.insync.replicas`` of 1, or new topics to be created
    with one replica (``creates_with``: ``topic_replication_factor``)."""
    metadata = admin.list_topics(timeout=_TIMEOUT_S)
    if len(metadata.brokers) < 2:
        return []  # one broker: every topic has one replica, nothing to advise
    topics = sorted(t for t in metadata.topics if relevant(t))[:_MAX_TOPICS]
    warnings = []
    single = [t for t in topics if _replicas(metadata.topics[t]) == 1]
    if single:
        warnings.append(
            f"topics {single} have one replica on a cluster of {len(metadata.brokers)} "
            "brokers: losing that broker stops their publication (and may lose records). "
            "Recommended: replication factor 3 (kafka-reassign-partitions)"
        )
    low_isr = sorted(t for t, isr in _min_isr(admin, topics).items() if isr < 2)
    if low_isr:
        warnings.append(
            f"topics {low_isr} have min.insync.replicas=1: a record is acknowledged once "
            "one broker has it, and lost if that broker's disk is. Recommended: 2 (with "
            "replication factor 3)"
        )
    warnings += _creation_warnings(admin, min(metadata.brokers), creates_with)
    for warning in warnings:
        logger.warning("%s", warning, extra=log_extra("kafka_replication_advice"))
    return warnings


def _creation_warnings(admin: AdminClient, broker: int, creates_with: int) -> list[str]:
    """What topics the relay creates will get: ``creates_with`` replicas, or (-1) the
    broker's defaults; and always the broker's ``min.insync.replicas``."""
    defaults = _configs(admin, ConfigResource(ResourceType.BROKER, str(broker)))
    replicas = defaults.get("default.replication.factor") if creates_with == -1 else creates_with
    warnings = []
    if replicas == 1:
        source = (
            "the brokers' default.replication.factor"
            if creates_with == -1
            else ("topic_replication_factor")
        )
        warnings.append(f"{source} is 1: topics the relay creates get one replica. Recommended: 3")
    if defaults.get("min.insync.replicas") == 1:
        warnings.append(
            "the brokers' min.insync.replicas is 1: topics the relay creates inherit it. "
            "Recommended: 2 (with replication factor 3)"
        )
    return warnings


def _configs(admin: AdminClient, resource: ConfigResource) -> dict[str, int]:
    """The integer settings of ``resource`` (empty when they cannot be read)."""
    future = admin.describe_configs([resource], request_timeout=_TIMEOUT_S)[resource]
    try:
        entries = future.result()
    except KafkaException as exc:  # not allowed to describe it, say: no advice
        logger.debug(
            "cannot describe %s: %s",
            resource,
            exc,
            extra=log_extra("kafka_describe_failed", resource=resource, error=exc),
        )
        return {}
    return {
        name: int(entry.value)
        for name, entry in entries.items()
        if entry.value is not None and entry.value.lstrip("-").isdigit()
    }


def _replicas(topic: Any) -> int:
    return min((len(p.replicas) for p in topic.partitions.values()), default=0)


def _min_isr(admin: AdminClient, topics: list[str]) -> Mapping[str, int]:
    """Each topic's effective ``min.insync.replicas`` (the broker's default included)."""
    if not topics:
        return {}
    futures = admin.describe_configs(
        [ConfigResource(ResourceType.TOPIC, t) for t in topics], request_timeout=_TIMEOUT_S
    )
    found = {}
    for resource, future in futures.items():
        try:
            entry = future.result().get("min.insync.replicas")
        except KafkaException as exc:  # not allowed to describe it, say: no advice
            logger.debug(
                "cannot describe topic %s: %s",
                resource.name,
                exc,
                extra=log_extra("kafka_describe_failed", topic=resource.name, error=exc),
            )
            continue
        if entry is not None and entry.value is not None and entry.value.isdigit():
            found[resource.name] = int(entry.value)
    return found
