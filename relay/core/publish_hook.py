"""What a part's worker tells of the batches it publishes: :class:`PublishHook`. The
relay's hook (relay/observability/tracing.py) keeps the commit→visible latency and,
with tracing on, the spans; without one, a worker tells nobody (:class:`NoHook`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from relay.core.model import KafkaRecord, OutboxEvent
from relay.core.subscribers import Subscriber


class PublishHook(Protocol):
    """Told by a part's worker of each batch it sends and of each it committed. One per
    worker: a worker sends one batch at a time."""

    def sending(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records``, about to be sent in one transaction, as they are to be sent."""
        ...

    def joining(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        """``records`` joining the transaction in flight, as they are to be sent."""
        ...

    def published(
        self, events: Sequence[OutboxEvent], records: Sequence[KafkaRecord], subscriber: Subscriber
    ) -> None:
        """``records`` of ``events`` are committed (visible) now."""
        ...

    def counts(self) -> dict[str, int]:
        """What the hook counted, exported per part with the worker's counters."""
        ...


class NoHook:
    """A worker's hook when it is given none: records go as they are, nothing is counted."""

    def sending(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        return records

    def joining(self, records: list[KafkaRecord]) -> list[KafkaRecord]:
        return records

    def published(
        self, events: Sequence[OutboxEvent], records: Sequence[KafkaRecord], subscriber: Subscriber
    ) -> None:
        pass

    def counts(self) -> dict[str, int]:
        return {}
