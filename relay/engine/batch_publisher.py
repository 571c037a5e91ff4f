"""One batch's fate: read and encode it, send it, blame what the broker refused, record
it. The part worker's loop (relay/engine/worker.py) hands a :class:`BatchPublisher` a
batch with the producer it borrowed for its turn, and gets back what became of it as a
value: :class:`Committed` (the new state, and the batch read meanwhile) or
:class:`Halted` (the poison policy 'halt', or the relay's own configuration). Within,
an attempt the broker failed as a whole comes back as :class:`Split`: its events go
again one per transaction. The poison policy returns its dead-letter decisions; no
one writes into another's dict, and a :class:`PartBatch` is never changed in place."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple
from uuid import UUID

from relay.core import dead_letter_tag
from relay.core.key_space import KeySpace, KeySpaceAction, report
from relay.core.log_fields import log_extra
from relay.core.log_sampling import SampledLog
from relay.core.model import KafkaRecord, OutboxEvent, PartId, Position, Unreadable
from relay.core.ports import (
    Batch,
    DeadLetter,
    DeadLetterDecision,
    Extension,
    PartState,
    PartStore,
    Publisher,
    Selection,
)
from relay.core.publish_hook import PublishHook
from relay.core.subscribers import PoisonPolicy, Subscriber
from relay.core.worker_stats import WorkerState, WorkerStats
from relay.engine.encoding import LOCAL_FORMATS, RecordEncoder
from relay.engine.poison import (
    MAX_DEAD_LETTER_ERROR_BYTES,
    MAX_STORED_ERROR_BYTES,
    cap,
    dead_letter_record,
)
from relay.engine.sessions import RelaySession
from relay.errors import (
    CheckpointConflict,
    ClaimLost,
    ConfigError,
    EncodingError,
    PoisonRecordError,
    RelayError,
    RetryableError,
)

# A part's lines keep the one logger they had before the worker was split in two:
# operators' filters (and the tests' captures) name it.
logger = logging.getLogger("relay.engine.worker")

_ADVANCE_ATTEMPTS = 5
# A record's size as the encoder counted it (KafkaRecord.size; -1: not counted).
_SIZE = itemgetter(KafkaRecord._fields.index("size"))


@dataclass(frozen=True, slots=True)
class PartBatch:
    """A batch on its one way through the worker: the events a fetch read, then their
    records, then (once sent) what became of it: grown by a batch that joined it, with
    the batch read meanwhile for later, or refused by the broker. Each step makes a new
    one (``dataclasses.replace``), per batch, never per event: the events and records
    lists are the only per-event objects it holds."""

    events: list[OutboxEvent]
    # How far the fetch read (past events the subscriber drops); None: nothing new.
    end: Position | None
    full: bool = False  # a backlog: the fetch came back full
    # Encoded ahead of time when every event encoded cleanly (or, on a dead-letter
    # subscriber, with ``decided``); None: encode on the slow path, which applies the
    # poison policy.
    records: list[KafkaRecord] | None = None
    ahead: PartBatch | None = None  # read while this one travelled, for after it
    refused: PoisonRecordError | None = None  # the broker refused one of its records
    # Decided ahead of time on a dead-letter subscriber: the dead-letter decisions of
    # ``records`` (those recorded before included).
    decided: Mapping[UUID, DeadLetterDecision] | None = None
    # What a cut left (its dead letters reached what one transaction takes): the next
    # batch, already read (issue #47: each cut used to read the batch again).
    rest: PartBatch | None = None

    def encoded(self, records: list[KafkaRecord], used: int) -> PartBatch:
        """This batch with ``records``, which cover its first ``used`` events; the
        others become its :attr:`rest`."""
        if used >= len(self.events):
            return dataclasses.replace(self, records=records)
        rest = PartBatch(self.events[used:], self.end, self.full)
        cut = self.events[:used]
        return dataclasses.replace(
            self, events=cut, end=cut[-1].key, full=True, records=records, rest=rest
        )


@dataclass(frozen=True, slots=True)
class Committed:
    """The batch is in Kafka and its checkpoint in Postgres: the part's ``state`` now,
    and the next batch, read meanwhile or left by a cut (None: fetch it)."""

    state: PartState
    ahead: PartBatch | None


@dataclass(frozen=True, slots=True)
class Split:
    """The broker failed several records together: ``events`` go again one per
    transaction, which finds the culprit without blaming its neighbours."""

    events: list[OutboxEvent]


@dataclass(frozen=True, slots=True)
class Halted:
    """The part halted (a poison event under 'halt', or the relay's configuration),
    and stays so until resumed; ``reason`` as its checkpoint row says it."""

    reason: str


class _Encoded(NamedTuple):
    """A batch's records, how many of its events they cover, and the dead-letter
    decisions that apply to them (those given, and those made while encoding)."""

    records: list[KafkaRecord]
    used: int
    dead: Mapping[UUID, DeadLetterDecision]


def record_error(stats: WorkerStats, state: WorkerState, exc: Exception) -> None:
    """Count ``exc`` in ``stats``, the worker now in ``state``."""
    with stats.lock:
        stats.errors += 1
        stats.last_error = str(exc)
        stats.state = state
        waits_on = exc.waits_on if isinstance(exc, RelayError) else None
        stats.waiting_on = waits_on if state is WorkerState.RETRYING else None


class PartReader:
    """Where a part's batches come from: the part as stored (with its database's key
    space), and its rows after a checkpoint, as the subscriber selects them."""

    def __init__(
        self, part: PartId, *, session: RelaySession, stats: WorkerStats, limits: Selection
    ) -> None:
        self.part, self.session, self.stats = part, session, stats
        self.limits = limits  # what every fetch reads at most

    def load(self, store: PartStore) -> PartState:
        """The part as stored; raises ClaimLost when this relay no longer owns it."""
        state = store.get_part(*self.part)
        if state.owner != self.session.id:
            raise ClaimLost(f"part {self.part} is not claimed by this relay")
        self.stats.checkpoint = state.checkpoint
        return state

    def key_space(self, store: PartStore) -> KeySpace | None:
        """Before anything is published on this connection: are the stored keys this
        cluster's? (A restore elsewhere may have moved the database under us.)"""
        check = store.check_key_space()
        if check is None:
            return None  # schema before migration 0004
        if check.action is not KeySpaceAction.UNCHANGED:
            report(check, f"part {self.part}")
            with self.stats.lock:
                if check.action is KeySpaceAction.REBASED:
                    self.stats.key_space_rebased += 1
                else:
                    self.stats.key_space_continued += 1
        return store.key_space()

    def fetch(self, store: PartStore, state: PartState) -> PartBatch:
        subscriber = state.subscriber
        # Rows the subscriber drops stay in Postgres (all but the last read, which
        # carries the checkpoint past them); matches() below still decides.
        selection = dataclasses.replace(
            self.limits,
            parts=subscriber.parts,
            aggregate_types=subscriber.aggregate_types,
            event_types=subscriber.event_types,
            raw_payloads=subscriber.publishing.raw_payloads,
        )
        events, read_to, full = store.fetch(state.checkpoint, selection)
        if state.skips:  # rare: a set lookup per event only while the operator skips some
            events = self._without_skips(events, state.skips)
        return PartBatch(events, read_to, full)

    def _without_skips(
        self, events: list[OutboxEvent], skips: frozenset[UUID]
    ) -> list[OutboxEvent]:
        """``events`` but those the operator skipped (`subscribers skip`): the batch's
        end still passes them, so its checkpoint does, in the batch's own commit."""
        kept = [e for e in events if e.message_id not in skips]
        for event in events:
            if event.message_id in skips:
                logger.info(
                    "part %s: event %s at %s skipped by the operator, not published",
                    self.part,
                    event.message_id,
                    event.key,
                    extra=self._log_extra("event_skipped", message_id=event.message_id),
                )
        return kept

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this part's log lines: the event, the part, then ``fields``."""
        return log_extra(event, part=self.part, **fields)


class BatchPublisher:
    """One part's batches, one at a time: fetched (or read ahead while the last one
    travelled), encoded, sent in one Kafka transaction through the producer the loop
    lends, and recorded with the Postgres checkpoint; the events the broker refuses are
    blamed one by one under the subscriber's poison policy."""

    def __init__(
        self,
        part: PartId,
        *,
        session: RelaySession,
        stats: WorkerStats,
        encoder: RecordEncoder,
        reader: PartReader,
        hook: PublishHook,
        poison_log: SampledLog,
    ) -> None:
        self.part, self.session, self.stats = part, session, stats
        self._encoder, self._reader, self._hook = encoder, reader, hook
        self._poison_log = poison_log
        self._poison = _PoisonPolicy(part, session, stats, poison_log)

    def prepare(
        self, store: PartStore, state: PartState, read: PartBatch | None = None
    ) -> PartBatch:
        """Fetch (or take ``read``: what a cut left) and encode the batch after
        ``state``'s checkpoint. A poison event is left to the slow path (a halt needs the
        store, which the batch in flight is using), but on a dead-letter subscriber: its
        dead letters are decided here, so a flood of them is encoded while the last
        batch commits, as a backlog of good events is."""
        batch = (
            self._reader.fetch(store, state)
            if read is None
            else PartBatch(read.events, read.end, read.full)
        )
        subscriber = state.subscriber
        try:
            if not subscriber.filtered:  # the usual subscriber: the batch in one call
                records = self._encoder.for_batches(subscriber)(batch.events)
            else:
                encode = self._encoder.for_subscriber(subscriber)
                records = [
                    encode(event)
                    for event in batch.events
                    if subscriber.matches(event) or _not_read(event)
                ]
        except Exception:  # whatever it is, the slow path names the event and its error
            if subscriber.on_poison is PoisonPolicy.DEAD_LETTER and batch.end is not None:
                return self._decide_ahead(store, state, batch)
            return batch
        return dataclasses.replace(batch, records=records)

    def _decide_ahead(self, store: PartStore, state: PartState, batch: PartBatch) -> PartBatch:
        """``batch`` of a dead-letter subscriber encoded with its poison events' dead
        letters, cut where one transaction's dead letters end; what only the slow path
        may do (halt on the relay's configuration, wait for a registry) is left to it."""
        assert batch.end is not None
        try:
            dead = store.dead_letters(state.name, state.checkpoint, batch.end)
            encoded = self._encode(store, state, batch.events, dead, ahead=True)
        except RelayError:  # the relay's configuration, a registry down...
            return batch  # the slow path meets it again
        if isinstance(encoded, Halted):
            return batch
        return dataclasses.replace(
            batch.encoded(encoded.records, encoded.used), decided=encoded.dead
        )

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        store: PartStore,
        producer: Publisher,
        state: PartState,
        batch: PartBatch,
        look_ahead: bool,
    ) -> Committed | Halted:
        """Publish ``batch`` with ``producer`` (reading the next one meanwhile if
        ``look_ahead``). A batch the broker failed as a whole is published again one
        event per transaction."""
        pending = [batch]  # what is left to publish, the next at the end
        while True:
            match self._publish_batch(store, producer, state, pending.pop(), look_ahead):
                case Split(events):
                    pending += [PartBatch([event], event.key) for event in reversed(events)]
                    look_ahead = False
                case Committed(state=state) if pending:
                    pass  # the next of the events split apart, from the new state
                case Committed() | Halted() as outcome:
                    return outcome

    def _publish_batch(
        self,
        store: PartStore,
        producer: Publisher,
        state: PartState,
        batch: PartBatch,
        look_ahead: bool,
    ) -> Committed | Split | Halted:
        """Publish ``batch`` in one transaction, after the poison policy dealt with what
        the broker refused."""
        if not self.session.valid():
            raise ClaimLost("this relay's session may have expired; not publishing")
        sending, dead = self._decided(store, state, batch)
        while True:
            if sending.records is None:
                encoded = self._encode(store, state, sending.events, dead)
                if isinstance(encoded, Halted):
                    return encoded
                sending, dead = sending.encoded(encoded.records, encoded.used), encoded.dead
            reader = None
            if look_ahead:  # what a cut left is encoded meanwhile, as a batch read
                prepare = functools.partial(self.prepare, store, read=sending.rest)
                reader = _ReadAhead(prepare, state, sending, self._hook.joining)
            sent = self._send(producer, state, sending, reader, _named(sending.events, dead))
            if sent.refused is None:
                return self._record(store, state, sent, dead, sending.rest)
            if sent.refused.ambiguous and len(sent.events) > 1:
                return Split(sent.events)
            blamed = self._blame(store, state, sent, sent.refused, dead)
            if isinstance(blamed, Halted):
                return blamed
            # Encoded again with the decision; what joined the batch stays in it. (What
            # a cut left is read again after it: a broker's refusal is rare.)
            assert sent.end is not None
            dead = {**dead, **blamed}
            sending, look_ahead = PartBatch(sent.events, sent.end, sent.full), False

    def _decided(
        self, store: PartStore, state: PartState, batch: PartBatch
    ) -> tuple[PartBatch, Mapping[UUID, DeadLetterDecision]]:
        """``batch`` as it goes out, its records kept if they still hold, and the
        dead-letter decisions that apply to it: made ahead with its records, or
        recorded before for its range (a reset moved the checkpoint back)."""
        assert batch.end is not None
        dead: Mapping[UUID, DeadLetterDecision] = {}
        if batch.decided is not None:
            dead = batch.decided
        elif state.subscriber.on_poison is PoisonPolicy.DEAD_LETTER:
            dead = store.dead_letters(state.name, state.checkpoint, batch.end)
        records = batch.records if batch.decided is not None or not dead else None
        return PartBatch(batch.events, batch.end, batch.full, records, rest=batch.rest), dead

    def _send(
        self,
        producer: Publisher,
        state: PartState,
        batch: PartBatch,
        reader: _ReadAhead | None,
        letters: list[tuple[Position, str]],
    ) -> PartBatch:
        """One attempt at publishing ``batch``: the batch as sent, grown by what joined
        it meanwhile, if anything, and with ``refused`` set if the broker refused it."""
        assert batch.records is not None and batch.end is not None
        end, records = batch.end, self._hook.sending(batch.records)
        if records is not batch.records:
            batch = dataclasses.replace(batch, records=records)
        may_extend = reader is None or reader.may_join
        sending = Batch(records, end, str(state.generation), may_extend, letters)
        refused = None
        try:
            producer.publish(sending, reader, self.session.valid)
        except PoisonRecordError as exc:
            if exc.wait is not None and state.subscriber.on_poison is PoisonPolicy.HALT:
                # It heals (a topic to be created, #48): waiting is never worse than
                # halting. Only 'dead-letter' takes the row, lest it hold back the rest.
                raise exc.wait from None
            refused = exc
        sent = reader.grown(batch) if reader is not None else batch
        return sent if refused is None else dataclasses.replace(sent, refused=refused)

    def _record(
        self,
        store: PartStore,
        state: PartState,
        sent: PartBatch,
        dead: Mapping[UUID, DeadLetterDecision],
        rest: PartBatch | None,
    ) -> Committed:
        """Checkpoint and count a committed batch, recording its dead-letter decisions
        with the checkpoint (never before: the transaction might have been aborted); the
        next batch is the one read meanwhile, else ``rest``, what a cut left of it."""
        assert sent.records is not None and sent.end is not None
        self._hook.published(sent.events, sent.records, state.subscriber)  # visible now
        letters = _letters(sent.events, dead)
        advanced = self.advance(store, state, sent.end, letters)
        self.count(sent.records, len(letters), sent.end)
        self._poison_log.tick()  # a summary of the poison warnings left out, when due
        # A reset meanwhile moves the checkpoint elsewhere, and a skip changes what is
        # dropped (it bumps the version, so the advance reloaded the part): what was read
        # ahead is void.
        same = advanced.checkpoint == sent.end and advanced.skips == state.skips
        following = sent.ahead if sent.ahead is not None else rest
        return Committed(advanced, following if same else None)

    def _blame(
        self,
        store: PartStore,
        state: PartState,
        sent: PartBatch,
        refused: PoisonRecordError,
        dead: Mapping[UUID, DeadLetterDecision],
    ) -> dict[UUID, DeadLetterDecision] | Halted:
        """The poison policy applied to the event of ``sent`` whose record the broker
        refused: its new dead-letter decision, or Halted."""
        event = _event_of(refused.record, sent.events)
        decision = dead.get(event.message_id)
        if decision is None:
            verdict = self._poison.judge(store, state, event, str(refused), sent.events)
        elif decision.minimal:
            # The minimal dead letter rejected too: no longer the row's doing but the
            # dead-letter topic's (a lower max.message.bytes, say).
            why = f"dead-letter record rejected: {refused.reason}"
            return self._poison.halt(store, state, event, why, sent.events)
        else:
            verdict = self._poison.minimal(event, decision, refused.reason)
        return verdict if isinstance(verdict, Halted) else {event.message_id: verdict}

    # -- recording ---------------------------------------------------------------------

    def advance(
        self, store: PartStore, state: PartState, end: Position, letters: list[DeadLetter]
    ) -> PartState:
        """Record a committed batch, even if the version moved (a pause, say) meanwhile."""
        for _ in range(_ADVANCE_ATTEMPTS):
            try:
                # Durable only with dead letters. A crash of Postgres that loses a
                # checkpoint leaves an earlier one of this generation: transactional
                # delivery's recovery adopts Kafka's; idempotent delivery publishes again
                # from it, as at-least-once allows (docs/design.md §5). Dead letters are
                # not rebuilt past the last Kafka transaction, and a durable commit makes
                # every earlier one durable (the WAL is written in order).
                version = store.advance(state, end, self.session.id, letters, durable=bool(letters))
                return dataclasses.replace(state, checkpoint=end, version=version)
            except CheckpointConflict as exc:
                current = self._reader.load(store)  # raises ClaimLost if a peer owns it now
                if current.generation != state.generation:
                    logger.info(
                        "part %s: checkpoint reset, reloading",
                        self.part,
                        extra=self._log_extra("part_checkpoint_moved"),
                    )
                    return current
                if current.checkpoint != state.checkpoint:
                    # Moved in the same generation: a restored database, a key-space
                    # rebase or a crash that lost asynchronous advances, not an
                    # operator. Going on from it would publish again what this batch
                    # committed; recovery adopts the batch's Kafka-side checkpoint
                    # instead, with its checks (docs/design.md §6).
                    raise CheckpointConflict(
                        f"part {self.part}: checkpoint moved to {current.checkpoint} "
                        f"in the same generation"
                    ) from exc
                state = current  # only the version moved: the batch is still the right one
        # Still racing after several tries: start over from recovery, which adopts the
        # Kafka-side checkpoint of the batch just committed instead of republishing it.
        raise CheckpointConflict(f"part {self.part}: could not record the batch ending at {end}")

    def count(self, records: list[KafkaRecord], dead_lettered: int, end: Position) -> None:
        published = len(records)
        sizes = list(map(_SIZE, records))  # as the encoder counted them: no call each
        size = sum(sizes) if min(sizes, default=0) >= 0 else sum(r.byte_size() for r in records)
        with self.stats.lock:
            self.stats.published += published
            self.stats.published_bytes += size
            self.stats.dead_lettered += dead_lettered
            self.stats.batches += 1
            self.stats.checkpoint = end
            if published:
                self.stats.last_published_at = time.time()

    # -- encoding ----------------------------------------------------------------------

    def _encode(
        self,
        store: PartStore,
        state: PartState,
        events: list[OutboxEvent],
        dead: Mapping[UUID, DeadLetterDecision],
        *,
        ahead: bool = False,
    ) -> _Encoded | Halted:
        """The batch's records, poison events dead-lettered, and how many of ``events``
        they cover (all, unless its dead letters are more than the Kafka-side checkpoint
        can name, or than batch_max_bytes holds: then up to the first too many).
        ``ahead``: while another batch travels, where the relay's configuration raises
        rather than halt the part."""
        subscriber = state.subscriber
        if not dead and _in_one_loop(subscriber):
            every = _encode_every(self._encoder.for_batches(subscriber), events)
            if every is not None:
                return _Encoded(every, len(events), dead)
        encode = self._encoder.for_subscriber(subscriber)
        decided = dict(dead)  # with the decisions made below: a dict of this batch's own
        records: list[KafkaRecord] = []
        cut = _Cut(self._reader.limits.max_bytes)
        for at, event in enumerate(events):
            if not subscriber.matches(event) and not _not_read(event):
                continue
            decision = decided.get(event.message_id)
            if decision is None:
                encoded = self._encode_one(store, state, encode, event, ahead, events)
                if isinstance(encoded, KafkaRecord):
                    records.append(encoded)
                    continue
                if isinstance(encoded, Halted):
                    return encoded
                decision = decided[event.message_id] = encoded
            letter = dead_letter_record(event, subscriber, decision)
            if not cut.admits(event.key, decision.topic, letter, at, len(records)):
                break
            records.append(letter)
        else:
            at = len(events)
        return _Encoded(*cut.cut(records, at), decided)

    def _encode_one(
        self,
        store: PartStore,
        state: PartState,
        encode: Callable[[OutboxEvent], KafkaRecord],
        event: OutboxEvent,
        ahead: bool,
        batch: list[OutboxEvent],
    ) -> KafkaRecord | DeadLetterDecision | Halted:
        """``event``'s record; or its dead-letter decision; or Halted (the 'halt'
        policy, or the relay's own configuration)."""
        try:
            return encode(event)
        except EncodingError as exc:
            error = str(exc)
        except ConfigError as exc:  # the relay's own configuration: never poison
            if ahead:
                raise
            return self._poison.halt_config(store, state, exc)
        except RetryableError:
            raise  # the registry is down, say: the batch waits and is retried
        except Exception as exc:  # a row the encoder did not foresee: still its poison
            if self._poison.warn():
                logger.warning(
                    "part %s: encoding event %s raised %s",
                    self.part,
                    event.message_id,
                    type(exc).__name__,
                    exc_info=exc,
                    extra=self._log_extra("encoding_raised", message_id=event.message_id),
                )
            error = f"{type(exc).__name__}: {exc}"
        return self._poison.judge(store, state, event, error, batch)

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this part's log lines: the event, the part, then ``fields``."""
        return log_extra(event, part=self.part, **fields)


class _PoisonPolicy:
    """What the subscriber's poison policy makes of an event it cannot publish: a
    dead-letter decision, returned to the batch it belongs to, or a halt."""

    def __init__(
        self, part: PartId, session: RelaySession, stats: WorkerStats, poison_log: SampledLog
    ) -> None:
        self.part, self.session, self.stats = part, session, stats
        self._poison_log = poison_log

    def warn(self) -> bool:
        """Whether a poison event's warning is logged: sampled, a flood logs a few, then
        a summary; one left out is counted."""
        if self._poison_log.allows():
            return True
        with self.stats.lock:
            self.stats.poison_warnings_sampled_out += 1
        return False

    def judge(
        self,
        store: PartStore,
        state: PartState,
        event: OutboxEvent,
        error: str,
        batch: list[OutboxEvent],
    ) -> DeadLetterDecision | Halted:
        """Apply the subscriber's policy to ``event`` of ``batch``: its dead-letter
        decision (recorded in Postgres with the checkpoint that passes the event), or
        Halted."""
        with self.stats.lock:
            self.stats.poisoned += 1
        error = cap(error, MAX_DEAD_LETTER_ERROR_BYTES)  # it may quote the row
        if state.subscriber.on_poison is PoisonPolicy.HALT:
            return self.halt(store, state, event, error, batch)
        decision = DeadLetterDecision(state.subscriber.dead_letter_topic_name, error)
        if self.warn():
            short = cap(error, MAX_STORED_ERROR_BYTES)  # the record keeps it all
            logger.warning(
                "part %s: poison event %s (%s:%s) goes to %s: %s",
                self.part,
                event.message_id,
                event.transaction_id,
                event.position,
                decision.topic,
                short,
                extra=self._log_extra(
                    "poison_dead_lettered", message_id=event.message_id, error=short
                ),
            )
        return decision

    def minimal(
        self, event: OutboxEvent, decision: DeadLetterDecision, reason: str
    ) -> DeadLetterDecision:
        """The dead letter of ``event`` was rejected: once more with the event's
        identity only; the part halts if that is rejected too."""
        if self.warn():
            logger.warning(
                "part %s: the dead letter of %s was rejected (%s); sending its identity only",
                self.part,
                event.message_id,
                reason,
                extra=self._log_extra("dead_letter_minimal", message_id=event.message_id),
            )
        return dataclasses.replace(decision, minimal=True)

    def halt_config(self, store: PartStore, state: PartState, exc: ConfigError) -> Halted:
        """Stop the part, whatever its poison policy, until the configuration is fixed
        and the subscriber resumed: no event is dead-lettered for the relay's fault."""
        message = f"configuration error: {exc}"
        store.halt(state, self.session.id, message)
        record_error(self.stats, WorkerState.HALTED, exc)
        logger.error(
            "part %s halted: %s",
            self.part,
            message,
            extra=self._log_extra("part_halted_config", error=message),
        )
        return Halted(message)

    def halt(
        self,
        store: PartStore,
        state: PartState,
        event: OutboxEvent,
        error: str,
        batch: list[OutboxEvent],
    ) -> Halted:
        """Halt the part on the poison ``event`` of ``batch`` (a batch starts just after
        the checkpoint), saying how to skip it alone, and what a reset past it would
        skip: the events of the batch up to it (issue #48)."""
        error = cap(error, MAX_DEAD_LETTER_ERROR_BYTES)
        subscriber = state.subscriber
        upto = [e for e in batch if e.key <= event.key and (subscriber.matches(e) or _not_read(e))]
        n = max(len(upto), 1)
        message = (
            f"poison event {event.message_id} at {event.key}: {error}. To skip this event "
            f"alone (every other event is published): `outbox-relay subscribers skip "
            f"{subscriber.name} --event {event.message_id}`; a reset to {event.key} would "
            f"skip {n} event(s) of this part, {n - 1} of them before this one"
        )
        store.halt(state, self.session.id, message, event.message_id)
        record_error(self.stats, WorkerState.HALTED, RelayError(message))
        logger.error(
            "part %s halted (policy 'halt'; `outbox-relay subscribers resume %s` retries it): %s",
            self.part,
            self.part.subscriber,
            message,
            extra=self._log_extra("part_halted_poison", message_id=event.message_id, error=error),
        )
        return Halted(message)

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this part's log lines: the event, the part, then ``fields``."""
        return log_extra(event, part=self.part, **fields)


class _ReadAhead:
    """The publisher's ``meanwhile``: reads and encodes the batch after the one in
    flight while it travels. When the relay is caught up, that batch joins the open
    transaction rather than waiting a whole cycle for the next one."""

    def __init__(
        self,
        prepare: Callable[[PartState], PartBatch],
        state: PartState,
        sent: PartBatch,
        joining: Callable[[list[KafkaRecord]], list[KafkaRecord]],
    ) -> None:
        assert sent.end is not None
        self._prepare, self._state, self._end = prepare, state, sent.end
        self._joining = joining  # the records as they join (tracing: the batch's context)
        # What it read, set on the producer's thread, read back once publish returned.
        self._following: PartBatch | None = None
        self._joined = False
        # A full batch means a backlog: what follows goes in its own full transaction,
        # so it is read while this one commits rather than offered to join it.
        self.may_join = not sent.full

    def __call__(self) -> Extension | None:
        following = self._prepare(dataclasses.replace(self._state, checkpoint=self._end))
        self._following = following
        if not self.may_join or not _joins(following, self._state):
            return None
        assert following.records is not None and following.end is not None
        self._joined = True
        records = self._joining(following.records)
        if records is not following.records:
            self._following = dataclasses.replace(following, records=records)
        return records, following.end

    def grown(self, batch: PartBatch) -> PartBatch:
        """``batch`` with what joined it, or with what was read ahead for later."""
        following = self._following
        if following is None:
            return batch
        if not self._joined:
            return dataclasses.replace(batch, ahead=following)
        assert batch.records is not None and following.records is not None
        # New lists: the publisher may keep the ones it was handed.
        return PartBatch(
            [*batch.events, *following.events],
            following.end,
            records=[*batch.records, *following.records],
        )


class _Cut:
    """Where a batch with dead letters is cut: before the first dead letter the
    Kafka-side checkpoint cannot name (docs/design.md §7), or that would take them past
    ``max_bytes`` (a dead letter outweighs a small row); never before the first. Told of
    each dead letter as it is made, so a cut batch encodes little past the cut."""

    # How often the tag is measured (it is deflated: no sum of sizes tells its size);
    # past the cut, at most this many dead letters are made for nothing.
    _EVERY = 256

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes, self._bytes = max_bytes, 0
        self._named = dead_letter_tag.Named()
        self._letters: list[tuple[Position, str]] = []
        self._at: list[tuple[int, int]] = []  # each dead letter's event and record

    def admits(
        self, key: Position, topic: str, letter: KafkaRecord, event: int, record: int
    ) -> bool:
        """Whether the dead letter of the event at ``event`` (its record at ``record``)
        joins the batch; False: the batch ends before that event."""
        self._bytes += letter.byte_size()
        if self._at and self._bytes > self._max_bytes:
            return False
        self._named.add(key, topic)
        self._letters.append((key, topic))
        self._at.append((event, record))
        return bool(len(self._at) % self._EVERY) or self._fits()

    def cut(self, records: list[KafkaRecord], end: int) -> tuple[list[KafkaRecord], int]:
        """The records of the batch and how many of its events they cover, given the
        ``records`` made and the ``end`` of the events they cover."""
        if self._fits():
            return records, end
        fit = dead_letter_tag.fitting(self._letters)  # at least 1: one always fits
        event, record = self._at[fit]
        return records[:record], event

    def _fits(self) -> bool:
        return self._named.size() <= dead_letter_tag.MAX_TAG_BYTES


def _joins(following: PartBatch, state: PartState) -> bool:
    """Whether a batch read ahead joins the transaction in flight: only when the relay
    is caught up (a backlog is better served by full batches, each overlapping the
    last one's commit), every event encoded cleanly, and no dead-letter decision (made
    on the slow path) could apply."""
    return (
        following.records is not None
        and following.end is not None
        and not following.full
        and state.subscriber.on_poison is not PoisonPolicy.DEAD_LETTER
    )


def _in_one_loop(subscriber: Subscriber) -> bool:
    """Whether a batch of ``subscriber`` with no dead-letter decision may be encoded by
    :func:`_encode_every`: no filter to apply, and a format encoded locally (a registry's
    answer may differ from one call to the next, and registering twice is not free)."""
    return (
        subscriber.aggregate_types is None
        and subscriber.event_types is None
        and subscriber.value_format in LOCAL_FORMATS
    )


def _encode_every(
    encode_all: Callable[[list[OutboxEvent]], list[KafkaRecord]], events: list[OutboxEvent]
) -> list[KafkaRecord] | None:
    """Every event's record, in one call for the batch: the usual batch (no filter, no
    dead letter decided yet) needs no filter call and no dead-letter lookup per event
    (hashing a UUID is a Python call). None when an event raised: a local format's
    encoding is a function of the event (:func:`_in_one_loop`), so the slow path meets
    the same error on it and applies the poison policy."""
    try:
        return encode_all(events)
    except Exception:
        return None  # the loop meets it again: poison, the relay's config, or a retry


def _letters(
    events: list[OutboxEvent], dead: Mapping[UUID, DeadLetterDecision]
) -> list[DeadLetter]:
    """The dead letters among ``events``, as Postgres records them: the error cut at
    MAX_STORED_ERROR_BYTES (the record on the dead-letter topic carries it whole)."""
    if not dead:
        return []
    return [
        DeadLetter(e.key, e.message_id, _stored(dead[e.message_id]))
        for e in events
        if e.message_id in dead
    ]


def _stored(decision: DeadLetterDecision) -> DeadLetterDecision:
    error = cap(decision.error, MAX_STORED_ERROR_BYTES)
    return decision if error is decision.error else dataclasses.replace(decision, error=error)


def _named(
    events: list[OutboxEvent], dead: Mapping[UUID, DeadLetterDecision]
) -> list[tuple[Position, str]]:
    """The dead letters among ``events`` as the Kafka-side checkpoint names them."""
    if not dead:
        return []
    return [(e.key, dead[e.message_id].topic) for e in events if e.message_id in dead]


def _not_read(event: OutboxEvent) -> bool:
    """A row the fetch left unread (too large): the fetch's own filters kept it, on its
    full columns; its text columns came back cut short, so they may not match here."""
    return type(event.payload) is Unreadable and not event.payload.read


def _event_of(record: KafkaRecord, events: list[OutboxEvent]) -> OutboxEvent:
    wanted = record.outbox_message_id
    for event in events:
        if str(event.message_id) == wanted:
            return event
    raise RelayError(f"the broker rejected a record the batch does not contain: {record.topic}")
