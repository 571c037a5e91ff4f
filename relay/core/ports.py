"""The relay's ports, and the types that cross them.

A part worker reads and checkpoints events through a :class:`PartStore` (Postgres:
``relay.adapters.postgres.store.OutboxStore``) and publishes them through a :class:`Publisher` (Kafka:
``relay.adapters.kafka.kafka.TransactionalPublisher`` or ``IdempotentPublisher``). The daemon around
the workers (``relay.daemon``, ``relay.engine.sessions``) holds its session, claims parts,
lists subscribers and keeps the outbox through a :class:`DaemonStore`, the part store
and more (Postgres: ``relay.adapters.postgres.store.OutboxStore`` too); the lease it holds is a
:class:`RelaySession`. What is on the topics is read back through a
:class:`TopicReader` (Kafka: ``relay.adapters.kafka.topic_reader.KafkaTopicReader``): by ``verify``,
the ``dev`` live view, the tests and the benchmarks. The topics the outbox created are
kept in a :class:`TopicRecord` (Postgres: ``relay.adapters.postgres.topic_record``),
which confines the topics rows choose. The operators' commands (``relay.ops``) take
theirs: the interventions' :class:`InterventionStore`, a definition's
:class:`DefinitionStore`, replay's :class:`ReplayLedger` and verify's
:class:`VerifyOutbox`; ``verify --through`` reads a consumer's sink through a
:class:`SinkReader` (the Spark archive: ``relay.adapters.sinks.archive`` and ``delta``)
or, for a projection (one row per key, no event ids), a :class:`ProjectionReader`
(``relay.adapters.postgres.projection``). In-memory
adapters of them all live in ``relay.adapters.memory`` (the interventions':
``InMemoryInterventions``; a definition's: ``InMemoryDefinitions``); ``tests/contracts/``
holds each port to the same contract, whichever adapter is behind it.

Nothing here imports a database or Kafka client: the worker and the daemon's logic
depend on these ports only (tests/unit/test_layers.py checks the worker).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable
from uuid import UUID

from relay.core.interventions import (
    Intervention,
    OperatorSkip,
    PartMove,
    Recorded,
    SkipTarget,
)
from relay.core.key_space import KeySpace, KeySpaceCheck
from relay.core.model import (
    ConsumedRecord,
    KafkaCheckpoint,
    KafkaRecord,
    OutboxEvent,
    PartId,
    Position,
)
from relay.core.subscribers import StartFrom, Subscriber

if TYPE_CHECKING:  # relay.core.replay imports this module (Selection)
    from relay.core.replay import OpenReplay, ReplayRange


@dataclass(frozen=True)
class PartState:
    """One part of a subscriber as stored: its checkpoint, CAS version and owner."""

    subscriber: Subscriber
    subscriber_id: UUID
    part: int
    checkpoint: Position
    version: int
    generation: UUID
    owner: UUID | None
    halted_error: str | None
    updated_at: datetime
    # Events after the checkpoint the operator skipped (`subscribers skip`): the worker
    # drops them when it meets them, so the checkpoint passes them with their batch.
    skips: frozenset[UUID] = frozenset()

    @property
    def name(self) -> str:
        return self.subscriber.name


@dataclass(frozen=True)
class SubscriberState:
    """A subscriber with every part's state (for listings and status)."""

    subscriber: Subscriber
    subscriber_id: UUID
    parts: list[PartState]

    @property
    def checkpoint(self) -> Position:
        """The oldest part checkpoint: every event at or before it is published."""
        return min(p.checkpoint for p in self.parts)


class PartWait(NamedTuple):
    """What a part owned by a live relay waits for, as its worker recorded it (issue #48;
    relay/engine/waiting.py)."""

    waits_on: str  # what RelayError.waits_on names: topic, postgres_privilege, ...
    error: str  # why, with what ends the wait
    since: datetime


class ExpiredSession(NamedTuple):
    """A relay's session that a peer deleted because its heartbeats stopped."""

    id: UUID
    hostname: str
    pid: int


@dataclass(frozen=True)
class HorizonHolder:
    """A backend whose open transaction keeps newer events from being published."""

    # None for a prepared transaction (state 'prepared'): no session holds it.
    pid: int | None
    xid: str
    state: str | None
    application_name: str | None
    # None, like state and query_start: another role's session, whose details this role
    # may not see (it lacks pg_read_all_stats).
    age_s: float | None
    query_start: datetime | None
    # A prepared transaction's name (COMMIT/ROLLBACK PREPARED takes it), owner and
    # database; None for a session.
    gid: str | None = None
    owner: str | None = None
    database: str | None = None

    def describe(self) -> str:
        """Who it is, for an operator: a session's pid, or a prepared transaction."""
        if self.gid is None:
            return f"pid {self.pid}"
        return (
            f"prepared transaction {self.gid!r} (owner {self.owner}, database "
            f"{self.database}; ROLLBACK PREPARED or COMMIT PREPARED ends it)"
        )


class RelaySession:
    """This relay process's row in the sessions table (its lease), as the workers see it.

    Not a Postgres connection (a "session" in ``pg_stat_activity``), nor a Spark session.

    :meth:`valid` is the local half of the lease: a relay whose heartbeats have not
    succeeded for most of the expiry (a network partition, a SIGSTOP) must assume a
    peer has expired it and stop publishing before it even learns so.
    """

    def __init__(self, session_id: UUID, timeout: float, heartbeat_interval: float) -> None:
        self.id = session_id
        self._timeout = timeout
        self._margin = heartbeat_interval
        self._renewed = time.monotonic()
        self.lost = threading.Event()

    def renewed(self, at: float) -> None:
        self._renewed = at

    def valid(self) -> bool:
        if self.lost.is_set():
            return False
        return time.monotonic() - self._renewed < self._timeout - self._margin


@dataclass(frozen=True)
class DeadLetterDecision:
    """A poison event goes to ``topic`` because of ``error`` (recorded in Postgres).
    ``minimal``: its dead letter carries the event's identity only (the broker refused
    the full one)."""

    topic: str
    error: str
    minimal: bool = False


class DeadLetter(NamedTuple):
    """A dead-letter decision about the event ``message_id`` at ``key``: recorded in
    Postgres only with the checkpoint that passes it, once the Kafka transaction that
    carried its record committed (docs/design.md §7)."""

    key: Position
    message_id: UUID
    decision: DeadLetterDecision


class Fetched(NamedTuple):
    """What one fetch read: the events to publish, in order; how far the read went
    (past the rows the subscriber's filters dropped; None: nothing new was read); and
    whether it came back full, a backlog with more to read."""

    events: list[OutboxEvent]
    read_to: Position | None
    full: bool = False


@dataclass(frozen=True, slots=True)
class Selection:
    """What one fetch reads: up to ``limit`` decided events of ``part`` (of ``parts``),
    and no more once their sizes (every column the relay reads, uncompressed) reach
    ``max_bytes`` (at least one). A row larger than ``max_row_bytes`` is not read: it
    comes back as its identity, its payload :class:`relay.core.model.Unreadable` (poison).
    Of those, the events the type filters (None: any) drop are left out: the fetch's
    ``read_to`` goes past them."""

    limit: int
    max_bytes: int = 2**62
    part: int = 0
    parts: int = 1
    aggregate_types: frozenset[str] | None = None
    event_types: frozenset[str] | None = None
    max_row_bytes: int = 2**62
    # The payloads as the JSON text Postgres returns (bytes), not loaded: for a format
    # that passes them through (``Format.raw_payloads``). A row whose text today's load
    # would change or refuse is loaded still (the store says which).
    raw_payloads: bool = False


class PartStore(Protocol):
    """What a part worker needs of the outbox: its part's events and checkpoint."""

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        """The events ``selection`` picks after ``after``, in publication order."""

    def get_part(self, name: str, part: int) -> PartState:
        """The part as stored, with the events after its checkpoint that the operator
        skipped; raises ``SubscriberError`` when there is none."""

    def advance(
        self,
        state: PartState,
        to: Position,
        owner: UUID,
        dead_letters: Sequence[DeadLetter] = (),
        *,
        durable: bool = True,
    ) -> int:
        """Compare-and-set ``state``'s checkpoint to ``to`` and record ``dead_letters``
        (events up to ``to``), all or nothing; returns the new version. Raises
        ``CheckpointConflict`` when the version or owner moved (nothing recorded).

        ``durable=False``: the store may acknowledge before the write is durable, so a
        crash of the store may lose it (with every later one) and leave an earlier
        checkpoint of the same generation. Only for a checkpoint that Kafka holds too."""

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        """Dead-letter decisions already recorded for events in ``(after, upto]`` (by a
        checkpoint that passed them before a reset moved it back)."""

    def halt(
        self, state: PartState, owner: UUID, error: str, message_id: UUID | None = None
    ) -> None:
        """Halt the part with ``error``, on the poison event ``message_id`` if it names
        one (`subscribers skip` of that event resumes the part); raises ``ClaimLost``
        when ``owner`` lost it."""

    def record_wait(
        self, part: PartId, owner: UUID, waits_on: str | None, error: str | None
    ) -> None:
        """Record in the part's row what it waits for (``waits_on``, ``error``) and since
        when, for ``status``; None clears it. Neither the checkpoint nor its version
        changes, and nothing is recorded unless ``owner`` holds the part."""

    def check_key_space(self) -> KeySpaceCheck | None:
        """Check (and repair) the stored keys' space; None before migration 0004."""

    def key_space(self) -> KeySpace: ...

    def key_of(self, message_id: UUID) -> Position | None:
        """The key of the event ``message_id``; None when the outbox lacks it."""

    def messages_at(self, keys: Sequence[Position]) -> dict[Position, UUID]:
        """The message id of the event at each of ``keys`` the outbox holds."""

    def translate(self, key_space: UUID, key: Position) -> Position:
        """A key of ``key_space`` as a key of the space rebased from it."""

    def close(self) -> None:
        """Release the connection; the store is not used again."""


class SubscriberWriter(Protocol):
    """What creates a subscriber or changes its definition: the relay's start-up (the
    subscribers its config declares) and ``subscribers add``."""

    def add(
        self,
        subscriber: Subscriber,
        start: StartFrom = StartFrom.BEGINNING,
        *,
        replace: bool = False,
    ) -> bool:
        """Create ``subscriber`` with its parts, free (True), or update its definition
        when ``replace`` (False; its checkpoints and part count stay). Raises
        ``SubscriberError`` when it exists and not ``replace``, or collides with another."""


class DaemonStore(PartStore, SubscriberWriter, Protocol):
    """What the relay daemon needs of the database besides a part's events: its session
    (lease) and its peers', claims on parts, the subscribers, and the outbox's upkeep
    (docs/design.md §4).

    A session lives until its ``expires_at``, which a heartbeat moves on; any relay
    deletes the expired ones, and a session deleted (expired or closed) frees every part
    it owned. A part has at most one owner, a session; claiming and releasing it move
    its version on, so a checkpoint written by an earlier owner fails its CAS.
    """

    @property
    def closed(self) -> bool:
        """Whether the store can no longer be used (closed, or its connection broken)."""

    # -- sessions ----------------------------------------------------------------------

    def open_session(self, hostname: str, pid: int, timeout: float) -> UUID:
        """A new session of the relay ``pid`` on ``hostname``, live for ``timeout`` s."""

    def heartbeat(self, session: UUID, timeout: float) -> bool:
        """Extend ``session`` by ``timeout`` s from now; False when it is gone (expired
        and deleted by a peer, or closed)."""

    def expire_sessions(self) -> Sequence[ExpiredSession]:
        """Delete the sessions past their expiry (their parts become free); returns them."""

    def next_expiry(self) -> float | None:
        """Seconds until the soonest live session expires; None when there is none."""

    def close_session(self, session: UUID) -> None:
        """Delete ``session``: every part it owns is free at once (cooperative release)."""

    def live_sessions(self) -> Sequence[UUID]:
        """The sessions not past their expiry, in id order (deleted or not)."""

    # -- claims ------------------------------------------------------------------------

    def claim(self, name: str, part: int, owner: UUID) -> bool:
        """Claim the free part for the session ``owner``; False when someone holds it (or
        there is no such part)."""

    def release(self, name: str, part: int, owner: UUID) -> bool:
        """Free the part; False when ``owner`` does not hold it."""

    # -- upkeep ------------------------------------------------------------------------

    def prune(self, older_than_s: float, batch: int = 10_000) -> Iterator[int]:
        """Delete published events older than ``older_than_s``, yielding each batch's
        count; never an event some part has yet to publish, nor one whose dead letter is
        not yet redriven."""

    def prune_dead_letters(
        self,
        subscriber: str | None = None,
        *,
        pending_older_than_s: float | None = None,
        batch: int = 10_000,
    ) -> Iterator[int]:
        """Delete dead letters whose retention is over, yielding each batch's count:
        redriven ones whose event :meth:`prune` deleted; with ``pending_older_than_s``
        (only when the operator says so), instead those not redriven, decided longer ago
        than that. ``subscriber``: its dead letters only."""

    def horizon_holders(self) -> Sequence[HorizonHolder]:
        """The transactions holding the publication horizon back, oldest first."""

    def sees_all_backends(self) -> bool:
        """Whether :meth:`horizon_holders` sees every role's transactions."""

    def list(self, name: str | None = None) -> Sequence[SubscriberState]:
        """Every subscriber (or the one named) with all its parts, by name; a subscriber
        without parts yet (being created) is left out."""


class LagSample(NamedTuple):
    """What the ``part_lag`` query reads of one part; ``relay.ops.lag`` makes its lag of it."""

    scanned: int  # rows after the checkpoint scanned, any part's: at most the scan
    counted: int  # of those, the part's own that match the subscriber's filters
    first_position: int | None  # position of the first row scanned
    last_position: int | None  # position of the newest row of the outbox
    # Seconds since the database recorded the part's oldest row after its checkpoint
    # (recorded_at; a writer's occurred_at only on a schema before migration 0018).
    age_s: float | None


class PartSkips(NamedTuple):
    """What the ``part_skips`` query reads of one part."""

    part: int
    beyond_horizon: bool  # the checkpoint sorts after rows yet to be written
    # Rows a checkpoint beyond the horizon jumped over, scanned (None: none); on a schema
    # before migration 0019, those of the last reset forward.
    scanned: int | None
    counted: int | None  # of those, the part's rows matching the subscriber's filters
    by_reset: int = 0  # events every reset forward skipped (the ledger, migration 0019)
    by_skip: int = 0  # events `subscribers skip` skipped


class LagStore(Protocol):
    """What a subscriber's status and lag are read from (``relay.ops.lag``): its parts,
    the rows after each part's checkpoint, and what the operator skipped."""

    def list(self, name: str | None = None) -> Sequence[SubscriberState]:
        """As :meth:`DaemonStore.list`."""

    def lag_sample(self, state: PartState, scan: int) -> LagSample:
        """The part's rows after its checkpoint, decided or not, scanned up to ``scan``."""

    def part_skips(self, name: str, scan: int | None) -> Sequence[PartSkips]:
        """Each part's events the operator skipped, and whether its checkpoint lies
        beyond the horizon (``scan``: rows scanned at most, None: all)."""


class StatusStore(DaemonStore, LagStore, Protocol):
    """What ``/metrics`` reads of the database (``relay.daemon.metrics``): the lag, the
    claims, the horizon and the sessions."""


class InterventionStore(SubscriberWriter, Protocol):
    """What the operators' interventions change and read of the subscribers
    (``relay.ops.interventions``: reset, skip, pause, remove, add, and their ledger);
    each change with its ledger entry, in one transaction (Postgres:
    ``relay.adapters.postgres.store.OutboxStore``)."""

    def get(self, name: str) -> SubscriberState:
        """The subscriber with its parts; ``SubscriberError`` when there is none."""

    def list(self, name: str | None = None) -> Sequence[SubscriberState]:
        """As :meth:`DaemonStore.list`."""

    def transaction(self) -> AbstractContextManager[Any]:
        """A transaction (a savepoint within one) around the calls made inside it: they
        are all written, or none."""

    def reset_target(self, name: str, to: StartFrom | Position) -> Position:
        """Where a reset of ``name`` to ``to`` puts the checkpoints ('now': the horizon);
        ``SubscriberError`` for a position beyond the horizon."""

    def moves(self, state: SubscriberState, target: Position) -> builtins.list[PartMove]:
        """What a reset of ``state``'s parts to ``target`` would do to each."""

    def reset(
        self, name: str, to: StartFrom | Position, record: Intervention | None = None
    ) -> builtins.list[PartMove]:
        """Move every part's checkpoint to ``to``, with ``record`` on the ledger; returns
        what it did to each part (counted under a lock on the parts)."""

    def skip_targets(self, name: str, message_ids: Sequence[UUID]) -> builtins.list[SkipTarget]:
        """What ``subscribers skip`` checks of each event (in the order asked)."""

    def skip(
        self, name: str, message_ids: Sequence[UUID], record: Intervention
    ) -> builtins.list[int]:
        """Skip these events of ``name``, with ``record`` on the ledger (refused, nothing
        changed, unless each may be skipped); returns the parts resumed."""

    def set_paused(self, name: str, paused: bool, record: Intervention | None = None) -> None:
        """Pause or resume (which clears a halt) every part, with ``record`` on the ledger."""

    def remove(self, name: str, record: Intervention | None = None) -> None:
        """Delete the subscriber and its checkpoints, with ``record`` on the ledger."""

    def record(self, intervention: Intervention) -> int:
        """Put ``intervention`` on the ledger; returns its entry's id."""

    def ledger(self, name: str) -> builtins.list[Recorded]:
        """The interventions recorded for subscribers named ``name``, oldest first."""

    def operator_skips(self, subscriber_id: UUID) -> builtins.list[OperatorSkip]:
        """What the operator skipped of the subscriber, per ledger entry and part."""


class DefinitionStore(InterventionStore, LagStore, Protocol):
    """What a subscriber's definition is written through (``relay.ops.subscribers``:
    ``subscribers add`` and ``set``, the relay's start-up): the interventions' store,
    the lag of the events a narrowed filter drops, and the writes of definitions."""

    def add_all(self, subscribers: Sequence[tuple[Subscriber, StartFrom]]) -> None:
        """:meth:`add` each (``replace``), all or none."""

    def replace(self, before: Subscriber, after: Subscriber) -> None:
        """Replace the definition ``before`` by ``after``, only if the stored one is
        still ``before`` (its pause aside): ``SubscriberError`` otherwise."""

    def index_parts(self) -> None:
        """Build the part indexes of every part count in use."""


class PendingDeadLetters(Protocol):
    """What ``dead-letters prune --pending-older-than`` reads and deletes (Postgres:
    ``relay.adapters.postgres.dead_letters.DeadLetterStore``)."""

    def subscriber(self, name: str) -> SubscriberState:
        """As :meth:`InterventionStore.get`."""

    def pending_before(self, name: str, older_than_s: float) -> builtins.list[UUID]:
        """The dead letters not redriven (nor in flight) decided more than
        ``older_than_s`` seconds ago."""

    def prune_pending(self, name: str, ids: Sequence[UUID], entry: Intervention) -> int:
        """Delete exactly ``ids`` of the dead letters still pending, with ``entry`` on
        the ledger, in one transaction; returns how many."""


class PublishedEvent(NamedTuple):
    """One event verify expects on a subscriber's topics (the ``published_events`` query)."""

    message_id: UUID
    key: Position
    aggregate_type: str
    event_type: str
    dead_lettered: bool
    redriven: bool  # dead-lettered, then redriven (dead-letters redrive)
    part: int


class ReplayedRanges(Protocol):
    """What verify reads of the replays on the ledger (``subscribers replay``)."""

    def replays(self, subscriber_id: UUID) -> list[OpenReplay]:
        """The subscriber's replays, by ledger entry, finished or not."""

    def events(self, wanted: ReplayRange) -> list[tuple[UUID, Position, str, str]]:
        """The events of the range (message id, key, aggregate type, event type)."""


class ReplayLedger(ReplayedRanges, Protocol):
    """What ``subscribers replay`` reads of its range and its replays, and the lock
    that keeps two runs of one subscriber's replay apart."""

    def count(self, wanted: ReplayRange) -> int:
        """How many events of the range its filters match."""

    def open(self, subscriber_id: UUID, wanted: ReplayRange) -> OpenReplay | None:
        """The replay with these arguments that has not finished, if any."""

    def exclusive(self, name: str, subscriber_id: UUID) -> AbstractContextManager[None]:
        """Hold the subscriber's replay lock; :class:`SubscriberError` when another
        replay of it holds it."""


class VerifyOutbox(ReplayedRanges, Protocol):
    """What verify reads of the outbox to check the topics against it: the events each
    subscriber part has published, and where the records it did not expect lie."""

    def published_events(self, subscriber: Subscriber) -> Iterator[PublishedEvent]:
        """Each part's events after its start and up to its checkpoint that match the
        subscriber's filters, read in one transaction (iterate to the end)."""

    def part_starts(self, name: str) -> list[tuple[int, Position]]:
        """The parts whose generation starts after the beginning (created 'now', or
        reset), with their start."""

    def placed(self, name: str, ids: Sequence[UUID]) -> dict[UUID, str]:
        """Where each id's row lies for the subscriber: 'before_start', 'ahead' or
        'filtered'; an id left out has no row (pruned)."""

    def event_keys(self, ids: Sequence[UUID], field: str) -> dict[UUID, EventKeys]:
        """Each id's type, aggregate id and payload ``field`` (an id left out has no row)."""

    def message_ids_at(self, positions: Sequence[Position]) -> dict[Position, UUID]:
        """The message id of the event at each position (a position left out has none)."""


# What ``meanwhile`` may hand back: more records for the batch in flight, and its new end.
Extension = tuple[Sequence[KafkaRecord], Position]
# What the publisher runs while a batch travels (see Publisher.publish).
Meanwhile = Callable[[], Extension | None]
# Whether this relay still holds the part (its session's lease): asked before a publisher
# fences the part's producers again on its own.
Owned = Callable[[], bool]


@dataclass(frozen=True, slots=True)
class Batch:
    """One publish: ``records`` (possibly none: every event was filtered out), the batch
    of the outbox that ends at ``end``, checkpointed under the part's ``generation``.
    ``may_extend``: whether ``meanwhile`` may grow it."""

    records: Sequence[KafkaRecord]
    end: Position
    generation: str
    may_extend: bool = True
    # The batch's dead letters: (key, dead-letter topic). The Kafka-side checkpoint
    # names them (relay/core/dead_letter_tag.py), so an owner that adopts it records
    # their decisions.
    dead_letters: Sequence[tuple[Position, str]] = ()


class Publisher(Protocol):
    """Publishes batches for one subscriber part."""

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        """Take over the part: fence earlier producers, return the Kafka-side checkpoint.
        Checkpoints written from now on are tagged with ``key_space``."""

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        """Publish ``batch``; return once all its records are durable.

        ``meanwhile`` runs once the records are handed to the client, while they travel:
        the caller prepares its next batch there. If it returns an extension, those
        records join this batch, which then ends where the extension does. With
        ``batch.may_extend`` False the caller promises it returns None: the publisher may
        then run it while the batch commits, so the next batch's reading overlaps the
        commit's round trips too (docs/design.md §5).

        ``owned`` is asked before the publisher fences the part's producers again on its
        own (an aborted transaction retried at a new epoch): a relay whose session lapsed
        meanwhile must not fence the peer that took the part over and publish the batch a
        second time. None: the caller holds the part by other means (a lock).

        Raises :class:`BrokerUnavailable` (retry), :class:`PoisonRecordError` (one record's
        fault) or :class:`ProducerFenced` (another relay owns the part now).
        """

    def close(self) -> None: ...


class TopicOrigin(StrEnum):
    """Why a topic is in the outbox's record of its topics (:class:`TopicRecord`)."""

    ROW = "row"  # a row's free template field named it: counts against max_created_topics
    DECLARED = "declared"  # the operator's: a fixed topic, or one a filter names
    ADOPTED = "adopted"  # on the cluster at the first start after migration 0017


class TopicRecord(Protocol):
    """The topics this outbox created, shared by all its relays and kept across restarts
    (Postgres: ``outbox_topics``, migration 0017; docs/design.md §7, "Rows name topics").
    A row may publish to an existing topic its template reaches only if it is recorded
    here, a filter names it or ``topic_allow`` matches it; the rows' own topics count
    against ``max_created_topics`` here, so the cap is exact across relays."""

    def recorded(self) -> frozenset[str] | None:
        """Every recorded topic; None when the schema keeps no record (before 0017)."""

    def record(self, topics: Iterable[str], origin: TopicOrigin) -> None:
        """Record ``topics`` (just created, or adopted), unless recorded already."""

    def reserve(self, topic: str, cap: int | None) -> bool | None:
        """Record ``topic`` as a row's, before creating it, if fewer than ``cap`` (None:
        no cap) rows' topics are recorded: True when it is recorded (now, or already),
        False when the cap is reached, None when the schema keeps no record."""

    def release(self, topic: str) -> None:
        """Forget a row's topic that was reserved but that the broker refused for good."""

    def row_topics(self) -> int | None:
        """How many topics rows made (what max_created_topics caps); None: no record."""

    def adoption_pending(self) -> bool:
        """Whether migration 0017 found an outbox that had published already, whose
        existing topics no relay has adopted yet."""

    def adopt(self, topics: Iterable[str]) -> bool:
        """Record ``topics`` as adopted and mark the adoption done, unless a relay did it
        first: True when this call did."""


# What a reader reports while it reads: (records read, records to read).
Progress = Callable[[int, int], None]


class SinkReader(Protocol):
    """Reads back what a consumer's sink holds (``verify --through``), as its readers
    see it: the archive's Parquet files through Spark's ``_spark_metadata`` log
    (``relay.adapters.sinks.archive``), its Delta table through the table's log
    (``relay.adapters.sinks.delta``). Registered by name in ``relay.wiring``."""

    def message_ids(self) -> Iterator[tuple[UUID, str]]:
        """Each row's message id and topic, a row held twice given twice (rows with
        no message id, not the relay's, left out). Raises :class:`SinkUnreadable`."""


class ProjectedRow(NamedTuple):
    """One row of a projection: its key (an order's id) and the ``(transaction_id,
    position)`` of the last event applied to it."""

    key: str
    at: Position


class ProjectionRead(NamedTuple):
    """What :meth:`ProjectionReader.read` gives."""

    quarantined: set[str]  # the record keys of the events it could not apply
    rows: Iterator[ProjectedRow]  # every row, once: streamed, so read it once


@runtime_checkable
class ProjectionReader(Protocol):
    """Reads back a projection (``verify --through projection``): one row per key, kept
    at its newest event, so it holds no event ids (the order projection:
    ``relay.adapters.postgres.projection``). Registered by name in ``relay.wiring``,
    beside the :class:`SinkReader` s."""

    key_field: str  # the payload field an event's key is in

    def projects(self, aggregate_type: str, event_type: str) -> bool:
        """Whether the projection applies events of this type (others are not its)."""

    def read(self) -> AbstractContextManager[ProjectionRead]:
        """One read of the projection, on one connection: the keys it quarantined, then
        its rows streamed (memory does not grow with the table), to be read within the
        ``with``. Raises :class:`SinkUnreadable` (on entering, or while rows are read)."""


class EventKeys(NamedTuple):
    """What a projection keys an event by (``VerifyOutbox.event_keys``)."""

    aggregate_type: str
    event_type: str
    aggregate_id: str  # the record's key
    field: str | None  # the payload field asked for (None: not there)


class TopicReader(Protocol):
    """Reads back what is committed on topics (read_committed), partition by partition
    from the start of the log: every record of a partition in its order."""

    def read(
        self, topics: Sequence[str], progress: Progress | None = None
    ) -> Iterator[ConsumedRecord]:
        """Every record committed to ``topics`` up to their end as of the call (a topic
        that does not exist has none); ``progress`` is told how far it got.
        Raises :class:`BrokerUnavailable` when the topics cannot be read to their end."""

    def follow(
        self, topics: Sequence[str], idle: float = 0.1, *, from_beginning: bool = True
    ) -> Generator[ConsumedRecord | None, None, None]:
        """Every record committed to ``topics``, then each one as it is committed, for
        as long as the caller iterates (close the iterator to stop); None each time
        ``idle`` seconds pass without one. A topic is read once it exists.
        ``from_beginning`` False: only records after the end the topics had when first
        read (every record of a topic created later); the first None comes after that."""
