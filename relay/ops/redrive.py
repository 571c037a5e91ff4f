"""Dead-letter redrive: publishing a subscriber's dead-lettered events once their cause
is fixed (a schema added, a topic allowed), exactly once and in their order per key.

Dead letters are read from ``outbox_dead_letters`` with the outbox rows they point at,
in publication order, and only up to each part's live checkpoint (what the live relay
has committed). The live checkpoint is never touched: the redriven events are published
as the relay would publish them now, under a commit protocol of their own, the relay's:

1. number the batch (``redrive_batch``) and mark its dead letters with the number;
2. one Kafka transaction: the batch's records, and the number as the committed offset
   of the redrive's consumer group (``<prefix>.redrive.<subscriber id>``);
3. mark the batch's dead letters redriven.

A redrive starts by fencing every earlier redrive of the subscriber (its
``transactional.id`` aborts an open transaction), then reads the last committed number:
that batch is marked redriven (a crash fell between 2 and 3), any other marked batch is
cleared (it never committed). Nothing is published twice.

An event that is still poison (it still cannot be encoded, or the broker refuses it)
stays dead-lettered with the reason (``redrive_error``), and so do the later dead
letters of its key, which would otherwise overtake it: a later redrive publishes them
in order once it is fixed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from relay.core.dead_letters import Candidate
from relay.core.formats.base import SchemaRegistry
from relay.core.log_fields import log_extra
from relay.core.model import KafkaCheckpoint, KafkaRecord, OutboxEvent, Position
from relay.core.ports import Batch, SubscriberState
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, TopicGuard
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import MAX_STORED_ERROR_BYTES, cap
from relay.errors import EncodingError, PoisonRecordError

logger = logging.getLogger(__name__)

# The redrive group's only generation: its committed offsets number redrive batches.
GENERATION = "batches"
DEFAULT_BATCH = 500


def group_prefix(kafka_id_prefix: str, subscriber_id: UUID) -> str:
    """Prefix of the redrive's ``transactional.id`` and consumer group: per subscriber
    identity, so a subscriber recreated under its name starts afresh."""
    return f"{kafka_id_prefix}.redrive.{subscriber_id}"


@dataclass
class RedriveReport:
    subscriber: str
    redriven: int = 0
    # Marked redriven from the Kafka side: a previous redrive committed them, then stopped.
    recovered: int = 0
    still_poison: dict[UUID, str] = field(default_factory=dict)
    held_back: list[UUID] = field(default_factory=list)  # behind a still-poison event
    missing: list[UUID] = field(default_factory=list)  # the outbox row was pruned

    @property
    def left(self) -> int:
        return len(self.still_poison) + len(self.held_back) + len(self.missing)

    def as_dict(self) -> dict[str, Any]:
        return {
            "subscriber": self.subscriber,
            "redriven": self.redriven,
            "recovered": self.recovered,
            "still_poison": {str(k): v for k, v in self.still_poison.items()},
            "held_back": [str(m) for m in self.held_back],
            "missing": [str(m) for m in self.missing],
        }


class RedriveStore(Protocol):
    """What a redrive reads and records in Postgres
    (``relay.adapters.postgres.dead_letters.DeadLetterStore``)."""

    def exclusive(self, name: str) -> AbstractContextManager[None]: ...

    def settle(self, name: str, committed: int) -> tuple[int, int]: ...

    def candidates(self, name: str, after: Position, limit: int) -> list[Candidate]: ...

    def begin(self, name: str, batch: int, ids: Sequence[UUID]) -> None: ...

    def abandon(self, name: str, batch: int) -> None: ...

    def done(self, name: str, batch: int) -> None: ...

    def refused(self, name: str, message_id: UUID, error: str) -> None: ...


class RedrivePublisher(Protocol):
    """What a redrive needs of a transactional publisher (the composition root's
    ``relay.wiring.exactly_once_publisher``)."""

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None: ...

    def publish(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


class Redrive:
    """One redrive of one subscriber's dead letters."""

    def __init__(
        self,
        store: RedriveStore,
        publisher: RedrivePublisher,
        encoder: RecordEncoder,
        state: SubscriberState,
        *,
        batch_size: int = DEFAULT_BATCH,
        progress: Callable[[RedriveReport], None] | None = None,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._encoder = encoder
        self._subscriber = state.subscriber
        self._batch_size = batch_size
        self._progress = progress
        self.report = RedriveReport(state.subscriber.name)
        self._blocked: set[str] = set()  # keys with a still-poison event
        self._batch = 0

    def run(self) -> RedriveReport:
        with self._store.exclusive(self._subscriber.name):
            return self._run()

    def _run(self) -> RedriveReport:
        name = self._subscriber.name
        committed = self._publisher.recover(GENERATION)  # fences earlier redrives first
        last = committed.position.transaction_id if committed is not None else 0
        self.report.recovered, self._batch = self._store.settle(name, last)
        if self.report.recovered:
            logger.warning(
                "subscriber %s: %s dead letters were redriven by a redrive that stopped "
                "before recording it; recorded now, not published again",
                name,
                self.report.recovered,
                extra=self._log_extra("redrive_settled", recovered=self.report.recovered),
            )
        after = Position(0, 0)
        while candidates := self._store.candidates(name, after, self._batch_size):
            after = candidates[-1].key
            self._publish(self._encode(candidates))
            if self._progress is not None:
                self._progress(self.report)
        return self.report

    def _encode(self, candidates: list[Candidate]) -> list[tuple[OutboxEvent, KafkaRecord]]:
        """The records of the candidates that can be published now, in order."""
        encoded = []
        for candidate in candidates:
            event = candidate.event
            if event is None:
                self.report.missing.append(candidate.message_id)
                self._refuse(candidate.message_id, "the outbox row is gone (pruned)")
            elif event.aggregate_id in self._blocked:
                self._hold(event)
            elif not self._subscriber.matches(event):
                self._poison(event, "the subscriber's filters no longer select it")
            else:
                try:
                    encoded.append((event, self._encoder.encode(event, self._subscriber)))
                except EncodingError as exc:
                    self._poison(event, str(exc))
                except Exception as exc:  # a row the encoder did not foresee: its poison
                    self._poison(event, f"{type(exc).__name__}: {exc}")
        return encoded

    def _publish(self, encoded: list[tuple[OutboxEvent, KafkaRecord]]) -> None:
        """Publish ``encoded`` in one transaction; a record the broker refuses stays
        dead-lettered (with its key's later events) and the rest goes again."""
        name = self._subscriber.name
        while encoded:
            batch = self._batch + 1
            # Any other failure leaves the batch marked: the next redrive learns from
            # Kafka whether its transaction committed.
            self._store.begin(name, batch, [event.message_id for event, _ in encoded])
            try:
                self._publisher.publish(
                    Batch([record for _, record in encoded], Position(batch, 0), GENERATION)
                )
            except PoisonRecordError as exc:
                self._store.abandon(name, batch)
                if exc.ambiguous and len(encoded) > 1:
                    # Several records failed together: one per transaction finds the culprit.
                    for one in encoded:
                        if one[0].aggregate_id in self._blocked:
                            self._hold(one[0])
                        else:
                            self._publish([one])
                    return
                encoded = self._without(encoded, exc)
                continue
            self._store.done(name, batch)
            self._batch = batch
            self.report.redriven += len(encoded)
            return

    def _without(
        self, encoded: list[tuple[OutboxEvent, KafkaRecord]], refused: PoisonRecordError
    ) -> list[tuple[OutboxEvent, KafkaRecord]]:
        wanted = refused.record.outbox_message_id
        culprit = next(
            (event for event, _ in encoded if str(event.message_id) == wanted), encoded[0][0]
        )
        self._poison(culprit, str(refused))
        kept = []
        for event, record in encoded:
            if event is culprit:
                continue
            if event.aggregate_id in self._blocked:
                self._hold(event)
                continue
            kept.append((event, record))
        return kept

    def _poison(self, event: OutboxEvent, error: str) -> None:
        error = cap(error, MAX_STORED_ERROR_BYTES)  # reported, stored and logged
        self.report.still_poison[event.message_id] = error
        self._blocked.add(event.aggregate_id)
        self._refuse(event.message_id, error)

    def _hold(self, event: OutboxEvent) -> None:
        self.report.held_back.append(event.message_id)
        self._refuse(event.message_id, "held back behind a still-poison event of its key")

    def _refuse(self, message_id: UUID, error: str) -> None:
        error = cap(error, MAX_STORED_ERROR_BYTES)  # it may quote the row
        self._store.refused(self._subscriber.name, message_id, error)
        logger.warning(
            "subscriber %s: dead letter %s stays: %s",
            self._subscriber.name,
            message_id,
            error,
            extra=self._log_extra("redrive_dead_letter_kept", message_id=message_id),
        )

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this redrive's log lines: the event, the subscriber, then
        ``fields``."""
        return log_extra(event, subscriber=self._subscriber.name, **fields)


# The schema registry's encoder the settings configure, over the writer schemas loaded
# (None: no registry): the composition root's (relay.wiring.registry_encoder).
RegistryEncoder = Callable[[Settings, SchemaFolder | None], SchemaRegistry | None]


def relay_encoder(
    settings: Settings, subscribers: Iterable[Subscriber], registry_encoder: RegistryEncoder
) -> tuple[TopicGuard, RecordEncoder]:
    """The relay's encoding of ``subscribers``' events as the settings say (schemas,
    schema registry), and the guard that confines their topics (``topic_allow``, the
    other subscribers' topics), for an operator's command that publishes as the relay
    does (redrive, replay)."""
    from relay.ops.subscribers import load_schemas

    schemas = load_schemas(settings)
    allow = None if settings.topic_allow is None else re.compile(settings.topic_allow)
    guard = TopicGuard(settings.checkpoint_topic, allow)
    guard.update(subscribers)
    return guard, RecordEncoder(schemas, guard, registry_encoder(settings, schemas))
