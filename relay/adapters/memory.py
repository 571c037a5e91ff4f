"""In-memory adapters of the relay's ports (``relay.core.ports``): a store
(:class:`InMemoryStore`, both the part and the daemon store), a publisher, a record of
the topics, a topic reader, a consumer's sink (:class:`InMemorySink`), and what replay
and verify read of the outbox and its ledger (:class:`InMemoryReplayLedger`,
:class:`InMemoryVerifyOutbox`), and the operators' interventions' store
(:class:`InMemoryInterventions`: resets, skips, pause and the ledger) and a definition's
(:class:`InMemoryDefinitions`: its writes, and the lag and skips of its parts), over
dicts and lists in this process.

They are for tests and benchmarks of the logic above the ports -- the part worker, the
daemon's claims and upkeep, the ops commands -- with no Postgres and no Kafka; the relay
itself never runs over them (its composition root, ``relay.wiring``, builds the real
adapters). ``tests/contracts/`` holds each of them to the same contract as its real
adapter (``relay.adapters.postgres``, ``relay.adapters.kafka``), so what passes over a
fake holds over the real thing. They stand on the core alone.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import NamedTuple
from uuid import UUID

from relay.core import dead_letter_tag
from relay.core.interventions import (
    Action,
    Intervention,
    OperatorSkip,
    PartMove,
    Recorded,
    SkipTarget,
    check_skippable,
    reset_entry,
    reset_target,
    resumed_parts,
)
from relay.core.key_space import KeySpace, KeySpaceAction, KeySpaceCheck
from relay.core.model import (
    ConsumedRecord,
    KafkaCheckpoint,
    KafkaRecord,
    OutboxEvent,
    PartId,
    Position,
    Unreadable,
)
from relay.core.ports import (
    Batch,
    DaemonStore,
    DeadLetter,
    DeadLetterDecision,
    DefinitionStore,
    EventKeys,
    ExpiredSession,
    Fetched,
    HorizonHolder,
    InterventionStore,
    LagSample,
    Meanwhile,
    Owned,
    PartSkips,
    PartState,
    Progress,
    ProjectedRow,
    ProjectionRead,
    ProjectionReader,
    PublishedEvent,
    ReplayLedger,
    Selection,
    SubscriberState,
    TopicOrigin,
    TopicRecord,
    VerifyOutbox,
)
from relay.core.replay import OpenReplay, ReplayRange, unfinished
from relay.core.subscribers import StartFrom, Subscriber, check_unchanged, collision
from relay.errors import CheckpointConflict, ClaimLost, DatabaseError, SubscriberError


class InMemorySessions(ABC):
    """The relays' sessions and their claims on parts, of :class:`InMemoryStore`: the
    daemon's port's sessions, on the store's clock and lock."""

    sessions: dict[UUID, _Session]
    parts: dict[tuple[str, int], PartState]
    _clock: Callable[[], float]
    _lock: threading.RLock

    @abstractmethod
    def _set(self, updated: PartState) -> PartState:
        """Store ``updated`` (the store's: every write of a part goes through it)."""

    # -- the daemon's port: sessions and claims ----------------------------------------

    def open_session(
        self, hostname: str, pid: int, timeout: float, *, session_id: UUID | None = None
    ) -> UUID:
        """As the port's; ``session_id`` gives the session an id chosen by the test."""
        with self._lock:
            session = session_id if session_id is not None else uuid.uuid4()
            self.sessions[session] = _Session(hostname, pid, self._clock() + timeout)
            return session

    def heartbeat(self, session: UUID, timeout: float) -> bool:
        with self._lock:
            held = self.sessions.get(session)
            if held is None:
                return False
            held.expires_at = self._clock() + timeout
            return True

    def expire_sessions(self) -> builtins.list[ExpiredSession]:
        with self._lock:
            now = self._clock()
            expired = [
                ExpiredSession(sid, s.hostname, s.pid)
                for sid, s in self.sessions.items()
                if s.expires_at < now
            ]
            for gone in expired:
                self.close_session(gone.id)
            return expired

    def next_expiry(self) -> float | None:
        with self._lock:
            now = self._clock()
            left = [s.expires_at - now for s in self.sessions.values() if s.expires_at >= now]
            return min(left, default=None)

    def close_session(self, session: UUID) -> None:
        with self._lock:
            if self.sessions.pop(session, None) is None:
                return
            # As the foreign key's ON DELETE SET NULL: the owner goes, the version stays.
            for state in list(self.parts.values()):
                if state.owner == session:
                    self._set(dataclasses.replace(state, owner=None))

    def live_sessions(self) -> builtins.list[UUID]:
        with self._lock:
            now = self._clock()
            return sorted(sid for sid, s in self.sessions.items() if s.expires_at >= now)

    def claim(self, name: str, part: int, owner: UUID) -> bool:
        with self._lock:
            state = self.parts.get((name, part))
            if state is None or state.owner is not None:
                return False
            if owner not in self.sessions:  # as the foreign key to the sessions refuses it
                raise DatabaseError(
                    f"postgres refused the operation [23503]: no session {owner}",
                    sqlstate="23503",
                )
            self._set(dataclasses.replace(state, owner=owner, version=state.version + 1))
            return True

    def release(self, name: str, part: int, owner: UUID) -> bool:
        with self._lock:
            state = self.parts.get((name, part))
            if state is None or state.owner != owner:
                return False
            self._set(dataclasses.replace(state, owner=None, version=state.version + 1))
            return True


class InMemoryStore(InMemorySessions):
    """A :class:`relay.core.ports.DaemonStore` (and so a ``PartStore``) over lists and dicts:
    one outbox whose every event is committed (decided), subscribers of any number of
    parts, and relays' sessions on a clock of the test's choosing.

    Set up as the Postgres store is: :meth:`add` a subscriber, :meth:`open_session` and
    :meth:`claim` its parts; :meth:`append` stands for an application's committed
    transaction. An event's part is a hash of its aggregate id, as in Postgres, though
    not the same hash. Safe to share between threads, as a pool of connections is.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.events: list[OutboxEvent] = []
        # When each event was recorded (Postgres' recorded_at, migration 0018): the age
        # retention reads, never a writer's occurred_at.
        self.recorded_at: dict[Position, float] = {}
        self.parts: dict[tuple[str, int], PartState] = {}
        # subscriber → message id → (event key, decision); and when each was decided
        # (none is ever redriven here: redrive runs on Postgres only).
        self.dead: dict[str, dict[UUID, tuple[Position, DeadLetterDecision]]] = {}
        # What each part waits for (its waits_on and error), as record_wait left it.
        self.waits: dict[PartId, tuple[str, str]] = {}
        # Every record_wait call, in order (how often a waiting part writes).
        self.wait_writes: builtins.list[PartId] = []
        self.decided_at: dict[UUID, float] = {}
        self.sessions: dict[UUID, _Session] = {}
        # (subscriber, part) → the events the operator skipped; the event a halt is on.
        self.skip_lists: dict[tuple[str, int], set[UUID]] = {}
        self.halted_on: dict[tuple[str, int], UUID | None] = {}
        # The ledger of interventions: an entry's id is its place, from 1.
        self.ledger: list[Intervention] = []
        # Where each part's generation starts (the beginning, or 'now' at its creation).
        self.starts: dict[tuple[str, int], Position] = {}
        # The subscribers a replay holds the lock of (InMemoryReplayLedger.exclusive).
        self.replaying: set[UUID] = set()
        self.key_space_id = uuid.uuid4()
        self.closed = False
        self._clock = clock
        self._lock = threading.RLock()

    # -- setting up, as an application and an operator would ---------------------------

    def append(self, event: OutboxEvent, recorded_at: float | None = None) -> OutboxEvent:
        """Commit ``event``; it gets the next key, whatever key it came with, and its
        size as JSON text unless it comes with one; recorded now, or at ``recorded_at``
        (a Unix time)."""
        with self._lock:
            last = self.events[-1].key if self.events else Position(100, 0)
            size = event.stored_bytes or len(json.dumps(event.payload)) + len(
                json.dumps(event.headers)
            )
            committed = event._replace(
                transaction_id=last.transaction_id + 1, position=1, stored_bytes=size
            )
            self.events.append(committed)
            self.recorded_at[committed.key] = time.time() if recorded_at is None else recorded_at
            return committed

    def set_paused(self, name: str, paused: bool) -> None:
        """Pause or resume (which clears a halt), bumping the versions as Postgres does."""
        with self._lock:
            for state in self._parts_of(name):
                subscriber = dataclasses.replace(state.subscriber, paused=paused)
                halted = state.halted_error if paused else None
                self._set(
                    dataclasses.replace(
                        state, subscriber=subscriber, version=state.version + 1, halted_error=halted
                    )
                )

    def skip(self, name: str, message_ids: Sequence[UUID], record: Intervention) -> list[int]:
        """As the Postgres store's: skip these events (refused unless each is in the
        outbox, taken by the subscriber, not published yet and not skipped already); a
        part halted on one of them resumes. Returns the parts resumed."""
        with self._lock:
            states = {s.part: s for s in self._parts_of(name)}
            subscriber = states[0].subscriber
            targets = []
            for message_id in message_ids:
                event = next((e for e in self.events if e.message_id == message_id), None)
                if event is None or not subscriber.matches(event):
                    raise SubscriberError(f"event {message_id} is not one {name!r} publishes")
                part = part_of(event.aggregate_id, subscriber.parts) if subscriber.parts > 1 else 0
                skipped = self.skip_lists.setdefault((name, part), set())
                if event.key <= states[part].checkpoint or message_id in skipped:
                    raise SubscriberError(f"event {message_id} is published or skipped already")
                targets.append((part, message_id))
            resumed = []
            for part, message_id in targets:
                self.skip_lists[name, part].add(message_id)
                state = self.get_part(name, part)
                halted_on_it = state.halted_error is not None and (
                    self.halted_on.get((name, part)) == message_id
                )
                if halted_on_it:
                    resumed.append(part)
                halted = None if halted_on_it else state.halted_error
                self._set(
                    dataclasses.replace(state, halted_error=halted, version=state.version + 1)
                )
            self.ledger.append(record)
            return sorted(resumed)

    def record(self, intervention: Intervention) -> int:
        """Put ``intervention`` on the ledger; returns its entry's id."""
        with self._lock:
            self.ledger.append(intervention)
            return len(self.ledger)

    def remove(self, name: str) -> None:
        """Delete the subscriber and its parts (their owners' workers find them gone)."""
        with self._lock:
            for state in self._parts_of(name):
                del self.parts[state.name, state.part]

    # -- the daemon's port: subscribers ------------------------------------------------

    def add(
        self,
        subscriber: Subscriber,
        start: StartFrom = StartFrom.BEGINNING,
        *,
        replace: bool = False,
    ) -> bool:
        with self._lock:
            for other in self.list():
                reason = other.subscriber.name != subscriber.name and collision(
                    subscriber, other.subscriber
                )
                if reason:
                    raise SubscriberError(
                        f"subscriber {subscriber.name!r} collides with "
                        f"{other.subscriber.name!r}: {reason}"
                    )
            existing = [s for (name, _), s in self.parts.items() if name == subscriber.name]
            if existing and not replace:
                raise SubscriberError(f"subscriber {subscriber.name!r} already exists")
            if existing:
                if len(existing) != subscriber.parts:
                    raise SubscriberError(
                        f"subscriber {subscriber.name!r} has {len(existing)} parts; the part "
                        "count is fixed at creation"
                    )
                for state in existing:  # busy workers reload the definition (a new version)
                    kept = dataclasses.replace(subscriber, paused=state.subscriber.paused)
                    self._set(
                        dataclasses.replace(state, subscriber=kept, version=state.version + 1)
                    )
                return False
            begin = Position(0, 0)
            if start is StartFrom.NOW and self.events:
                begin = Position(self.events[-1].transaction_id + 1, 0)
            subscriber_id = uuid.uuid4()
            for part in range(subscriber.parts):
                self.starts[subscriber.name, part] = begin
                self._set(
                    PartState(
                        subscriber=subscriber,
                        subscriber_id=subscriber_id,
                        part=part,
                        checkpoint=begin,
                        version=1,
                        generation=uuid.uuid4(),
                        owner=None,
                        halted_error=None,
                        updated_at=datetime.now(UTC),
                    )
                )
            return True

    def list(self, name: str | None = None) -> list[SubscriberState]:
        with self._lock:
            found: dict[str, list[PartState]] = {}
            for (subscriber, _), state in sorted(self.parts.items()):
                if name is None or subscriber == name:
                    found.setdefault(subscriber, []).append(self._with_skips(state))
        return [SubscriberState(p[0].subscriber, p[0].subscriber_id, p) for p in found.values()]

    # -- the daemon's port: upkeep -----------------------------------------------------

    def prune(self, older_than_s: float, batch: int = 10_000) -> Iterator[int]:
        while True:
            with self._lock:
                doomed = self._prunable(older_than_s)[:batch]
                for event in doomed:
                    self.events.remove(event)
            if not doomed:
                return
            yield len(doomed)

    def prune_dead_letters(
        self,
        subscriber: str | None = None,
        *,
        pending_older_than_s: float | None = None,
        batch: int = 10_000,
    ) -> Iterator[int]:
        if pending_older_than_s is None:
            return  # none is redriven here
        cutoff = time.time() - pending_older_than_s
        while True:
            with self._lock:
                doomed = [
                    (name, m)
                    for name, recorded in self.dead.items()
                    if subscriber in (None, name)
                    for m in recorded
                    if self.decided_at.get(m, 0.0) < cutoff
                ][:batch]
                for name, message_id in doomed:
                    del self.dead[name][message_id]
            if not doomed:
                return
            yield len(doomed)

    def horizon_holders(self) -> builtins.list[HorizonHolder]:
        return []  # every event here is committed: nothing holds the horizon

    def sees_all_backends(self) -> bool:
        return True

    # -- the port ---------------------------------------------------------------------

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        limit, max_bytes = selection.limit, selection.max_bytes
        read: list[OutboxEvent] = []
        size = 0
        with self._lock:
            events = list(self.events)
        for event in events:
            if event.key <= after:
                continue
            if selection.parts > 1 and part_of(event.aggregate_id, selection.parts) != (
                selection.part
            ):
                continue
            if len(read) == limit or (read and size >= max_bytes):
                break
            read.append(event)
            size += event.stored_bytes
        if not read:
            return Fetched([], None)
        aggregate_types, event_types = selection.aggregate_types, selection.event_types
        kept = [
            _unless_too_large(e, selection.max_row_bytes)
            for e in read
            if (aggregate_types is None or e.aggregate_type in aggregate_types)
            and (event_types is None or e.event_type in event_types)
        ]
        if selection.raw_payloads:
            kept = [_as_text(e) for e in kept]
        return Fetched(kept, read[-1].key, len(read) == limit or size >= max_bytes)

    def get_part(self, name: str, part: int) -> PartState:
        state = self.parts.get((name, part))
        if state is None:
            raise SubscriberError(f"no subscriber part {name}/{part}")
        return self._with_skips(state)

    def _with_skips(self, state: PartState) -> PartState:
        """``state`` with the skipped events after its checkpoint, as Postgres reads them."""
        skipped = self.skip_lists.get((state.name, state.part))
        if not skipped:
            return state
        keys = {e.message_id: e.key for e in self.events if e.message_id in skipped}
        pending = frozenset(m for m, key in keys.items() if key > state.checkpoint)
        return dataclasses.replace(state, skips=pending)

    def advance(
        self,
        state: PartState,
        to: Position,
        owner: UUID,
        dead_letters: Sequence[DeadLetter] = (),
        *,
        durable: bool = True,
    ) -> int:
        # Every write is durable here: a lost one is simulated by moving the part back.
        with self._lock:
            return self._advance(state, to, owner, dead_letters)

    def _advance(
        self, state: PartState, to: Position, owner: UUID, dead_letters: Sequence[DeadLetter]
    ) -> int:
        current = self.get_part(state.name, state.part)
        if current.version != state.version or current.owner != owner or to < current.checkpoint:
            raise CheckpointConflict(
                f"checkpoint of {state.name}/{state.part} changed underneath this relay"
            )
        recorded = self.dead.setdefault(state.name, {})
        for letter in dead_letters:
            recorded.setdefault(letter.message_id, (letter.key, letter.decision))
            self.decided_at.setdefault(letter.message_id, time.time())
        return self._set(
            dataclasses.replace(current, checkpoint=to, version=current.version + 1)
        ).version

    def dead_letters(
        self, name: str, after: Position, upto: Position
    ) -> dict[UUID, DeadLetterDecision]:
        recorded = self.dead.get(name, {})
        return {m: d for m, (key, d) in recorded.items() if after < key <= upto}

    def halt(
        self, state: PartState, owner: UUID, error: str, message_id: UUID | None = None
    ) -> None:
        with self._lock:
            current = self.get_part(state.name, state.part)
            if current.owner != owner:
                raise ClaimLost(f"{state.name}/{state.part} is no longer claimed by this relay")
            self.halted_on[state.name, state.part] = message_id
            self._set(dataclasses.replace(current, halted_error=error, version=current.version + 1))

    def record_wait(
        self, part: PartId, owner: UUID, waits_on: str | None, error: str | None
    ) -> None:
        with self._lock:
            self.wait_writes.append(part)
            if self.get_part(*part).owner != owner:
                return
            if waits_on is None or error is None:
                self.waits.pop(part, None)
            else:
                self.waits[part] = (waits_on, error)

    def check_key_space(self) -> KeySpaceCheck | None:
        return KeySpaceCheck(KeySpaceAction.UNCHANGED, self.key_space_id, 0, None)

    def key_space(self) -> KeySpace:
        return KeySpace(self.key_space_id, None, None)

    def key_of(self, message_id: UUID) -> Position | None:
        return next((e.key for e in self.events if e.message_id == message_id), None)

    def messages_at(self, keys: Sequence[Position]) -> dict[Position, UUID]:
        wanted = set(keys)
        return {e.key: e.message_id for e in self.events if e.key in wanted}

    def translate(self, key_space: UUID, key: Position) -> Position:
        # This store is never restored elsewhere, so no key space was rebased from it.
        raise SubscriberError(f"key space {key_space} was never rebased into this store")

    def close(self) -> None:
        self.closed = True

    def _set(self, updated: PartState) -> PartState:
        # Skips are kept apart (skip_lists): the stored state holds none.
        updated = dataclasses.replace(updated, updated_at=datetime.now(UTC), skips=frozenset())
        self.parts[updated.name, updated.part] = updated
        return updated

    def _parts_of(self, name: str) -> builtins.list[PartState]:
        found = [state for (subscriber, _), state in self.parts.items() if subscriber == name]
        if not found:
            raise SubscriberError(f"no subscriber named {name!r}")
        return found

    def _prunable(self, older_than_s: float) -> builtins.list[OutboxEvent]:
        """Events every part has published, older than ``older_than_s``, but a stream's
        latest version (the next event-sourced append checks that it exists) and a
        dead letter's event."""
        if not self.parts:
            return []
        published = min(state.checkpoint for state in self.parts.values())
        cutoff = time.time() - older_than_s
        versions = {(e.aggregate_type, e.aggregate_id, e.aggregate_version) for e in self.events}
        # A dead letter's event stays until it is redriven (never, here) or pruned.
        dead = {key for recorded in self.dead.values() for key, _ in recorded.values()}
        return [
            e
            for e in self.events
            if e.key <= published
            and e.key not in dead
            and self.recorded_at.get(e.key, 0.0) <= cutoff
            and (
                e.aggregate_version is None
                or (e.aggregate_type, e.aggregate_id, e.aggregate_version + 1) in versions
            )
        ]


class InMemoryReplayLedger:
    """A :class:`relay.core.ports.ReplayLedger` over an in-memory store's events and
    ledger: each one over a store stands for a connection of its own."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store = store

    def count(self, wanted: ReplayRange) -> int:
        return len(self.events(wanted))

    def events(self, wanted: ReplayRange) -> builtins.list[tuple[UUID, Position, str, str]]:
        with self.store._lock:
            found = [e for e in self.store.events if wanted.covers(e)]
        return [(e.message_id, e.key, e.aggregate_type, e.event_type) for e in found]

    def replays(self, subscriber_id: UUID) -> builtins.list[OpenReplay]:
        with self.store._lock:
            entries = [
                (n, i.params, i.events)
                for n, i in enumerate(self.store.ledger, 1)
                if i.subscriber_id == subscriber_id and i.action is Action.REPLAY
            ]
        done = {p.get("of") for _, p, _ in entries if p.get("replay") == "done"}
        return [
            OpenReplay(n, ReplayRange.from_args(p["args"]), events or 0, n in done)
            for n, p, events in entries
            if p.get("replay") == "start"
        ]

    def open(self, subscriber_id: UUID, wanted: ReplayRange) -> OpenReplay | None:
        return unfinished(self.replays(subscriber_id), wanted)

    @contextmanager
    def exclusive(self, name: str, subscriber_id: UUID) -> Iterator[None]:
        with self.store._lock:
            if subscriber_id in self.store.replaying:
                raise SubscriberError(f"another replay of subscriber {name!r} is running")
            self.store.replaying.add(subscriber_id)
        try:
            yield
        finally:
            with self.store._lock:
                self.store.replaying.discard(subscriber_id)


class InMemoryVerifyOutbox(InMemoryReplayLedger):
    """A :class:`relay.core.ports.VerifyOutbox` over an in-memory store: each part's
    events after its start up to its checkpoint (none is ever redriven here)."""

    def published_events(self, subscriber: Subscriber) -> Iterator[PublishedEvent]:
        with self.store._lock:
            parts = {s.part: s for s in self.store._parts_of(subscriber.name)}
            dead = set(self.store.dead.get(subscriber.name, {}))
            events = builtins.list(self.store.events)
        for e in events:
            part = _part(e, subscriber.parts)
            state = parts.get(part)
            start = self.store.starts.get((subscriber.name, part), Position(0, 0))
            if state and start < e.key <= state.checkpoint and subscriber.matches(e):
                yield PublishedEvent(
                    e.message_id, e.key, e.aggregate_type, e.event_type,
                    e.message_id in dead, False, part,
                )  # fmt: skip

    def part_starts(self, name: str) -> builtins.list[tuple[int, Position]]:
        with self.store._lock:
            starts = sorted((p, at) for (n, p), at in self.store.starts.items() if n == name)
        return [(part, at) for part, at in starts if at > Position(0, 0)]

    def placed(self, name: str, ids: Sequence[UUID]) -> dict[UUID, str]:
        with self.store._lock:
            parts = {s.part: s for s in self.store._parts_of(name)}
            events = [e for e in self.store.events if e.message_id in set(ids)]
        if not parts:
            return {}
        found = {}
        for e in events:
            part = _part(e, len(parts))
            start = self.store.starts.get((name, part), Position(0, 0))
            if e.key <= start:
                found[e.message_id] = "before_start"
            elif e.key > parts[part].checkpoint:
                found[e.message_id] = "ahead"
            else:
                found[e.message_id] = "filtered"
        return found

    def event_keys(self, ids: Sequence[UUID], field: str) -> dict[UUID, EventKeys]:
        with self.store._lock:
            events = [e for e in self.store.events if e.message_id in set(ids)]
        return {
            e.message_id: EventKeys(
                e.aggregate_type, e.event_type, e.aggregate_id, _payload_field(e, field)
            )
            for e in events
        }

    def message_ids_at(self, positions: Sequence[Position]) -> dict[Position, UUID]:
        wanted = set(positions)
        with self.store._lock:
            return {e.key: e.message_id for e in self.store.events if e.key in wanted}


class InMemoryInterventions:
    """A :class:`relay.core.ports.InterventionStore` over an in-memory store's parts,
    skip lists and ledger, as the Postgres one's queries change and read them
    (``relay.adapters.postgres.intervention_queries``); ``db_role`` stands for the
    database's ``session_user`` on the ledger."""

    def __init__(self, store: InMemoryStore, db_role: str = "memory") -> None:
        self.store = store
        self.db_role = db_role
        # When each ledger entry was recorded (by id; the database's clock in Postgres).
        self.recorded_at: dict[int, datetime] = {}
        # What each entry skipped, as outbox_skipped holds it: one event or a reset's range.
        self.skipped: builtins.list[_Skipped] = []

    # -- the subscribers, and a transaction around changes ----------------------------

    def get(self, name: str) -> SubscriberState:
        found = self.list(name)
        if not found:
            raise SubscriberError(f"no subscriber named {name!r}")
        return found[0]

    def list(self, name: str | None = None) -> builtins.list[SubscriberState]:
        return self.store.list(name)

    def add(
        self,
        subscriber: Subscriber,
        start: StartFrom = StartFrom.BEGINNING,
        *,
        replace: bool = False,
    ) -> bool:
        return self.store.add(subscriber, start, replace=replace)

    @contextmanager
    def transaction(self) -> Generator[None]:
        """Under the store's lock; what the calls inside changed is undone when one raises
        (a savepoint, when nested)."""
        store = self.store
        with store._lock:
            saved = (
                dict(store.parts), {k: set(v) for k, v in store.skip_lists.items()},
                dict(store.halted_on), builtins.list(store.ledger), dict(store.starts),
                dict(self.recorded_at), builtins.list(self.skipped),
            )  # fmt: skip
            try:
                yield
            except BaseException:
                (store.parts, store.skip_lists, store.halted_on, store.ledger, store.starts,
                 self.recorded_at, self.skipped) = saved  # fmt: skip
                raise

    # -- pause, reset and remove -------------------------------------------------------

    def set_paused(self, name: str, paused: bool, record: Intervention | None = None) -> None:
        with self.transaction():
            self.store.set_paused(name, paused)
            if record is not None:
                self.record(record)

    def remove(self, name: str, record: Intervention | None = None) -> None:
        with self.transaction():
            parts = [s.part for s in self.store._parts_of(name)]
            self.store.remove(name)
            for part in parts:  # the checkpoints' rows held them
                self.store.skip_lists.pop((name, part), None)
                self.store.halted_on.pop((name, part), None)
            if record is not None:
                self.record(record)

    def horizon(self) -> int:
        """Every event here is committed: the next transaction id (101 is the first one
        ``InMemoryStore.append`` gives)."""
        with self.store._lock:
            events = self.store.events
            return events[-1].transaction_id + 1 if events else 101

    def reset_target(self, name: str, to: StartFrom | Position) -> Position:
        return reset_target(name, to, self.horizon)

    def moves(self, state: SubscriberState, target: Position) -> builtins.list[PartMove]:
        """The part's events between its checkpoint and ``target`` that the filters take,
        but those the operator skipped already (count_moved_events)."""
        subscriber = state.subscriber
        with self.store._lock:
            skipped = {k.message_id for k in self.skipped if k.subscriber_id == state.subscriber_id}
            events = [
                e
                for e in self.store.events
                if subscriber.matches(e) and e.message_id not in skipped
            ]
        moves = []
        for part in sorted(state.parts, key=lambda p: p.part):
            low, high = sorted((part.checkpoint, target))
            count = sum(
                1 for e in events if low < e.key <= high and _part(e, subscriber.parts) == part.part
            )
            moves.append(PartMove(part.part, part.checkpoint, target, count))
        return moves

    def reset(
        self, name: str, to: StartFrom | Position, record: Intervention | None = None
    ) -> builtins.list[PartMove]:
        with self.transaction():
            self.store._parts_of(name)  # none: SubscriberError, before the target's
            target = self.reset_target(name, to)
            state = self.get(name)
            moves = self.moves(state, target)
            for part in state.parts:  # a new generation, from the target (reset_checkpoint)
                self.store.starts[name, part.part] = target
                self.store._set(
                    dataclasses.replace(
                        part, checkpoint=target, version=part.version + 1,
                        generation=uuid.uuid4(), halted_error=None,
                    )
                )  # fmt: skip
            if record is not None:
                self._record_reset(record, state.subscriber_id, moves)
        return moves

    def _record_reset(
        self, record: Intervention, subscriber_id: UUID, moves: builtins.list[PartMove]
    ) -> None:
        entry = self.record(reset_entry(record, moves))
        for m in moves:
            if m.skips and m.events:
                self.skipped.append(
                    _Skipped(entry, subscriber_id, m.part, m.events, None, m.before, m.after)
                )

    # -- skips and the ledger ----------------------------------------------------------

    def skip_targets(self, name: str, message_ids: Sequence[UUID]) -> builtins.list[SkipTarget]:
        with self.store._lock:
            state = self.get(name)
            return [self._skip_target(state, m) for m in message_ids]

    def _skip_target(self, state: SubscriberState, message_id: UUID) -> SkipTarget:
        """As the skip_targets query's row, its NULLs (an event not in the outbox) too."""
        subscriber = state.subscriber
        event = next((e for e in self.store.events if e.message_id == message_id), None)
        part = (
            0
            if subscriber.parts == 1
            else None
            if event is None
            else _part(event, subscriber.parts)
        )
        checkpoint = None if part is None else state.parts[part]
        unfiltered = subscriber.aggregate_types is None and subscriber.event_types is None
        matches = unfiltered or None if event is None else subscriber.matches(event)
        skipped_by = next(
            (k.entry for k in self.skipped
             if k.subscriber_id == state.subscriber_id and k.message_id == message_id),
            None,
        )  # fmt: skip
        halted_on_it: bool | None = False
        if checkpoint is not None and checkpoint.halted_error is not None:
            on = self.store.halted_on.get((state.subscriber.name, checkpoint.part))
            halted_on_it = None if on is None else on == message_id
        return SkipTarget(
            message_id, None if event is None else event.key,
            None if event is None else event.aggregate_type,
            None if event is None else event.event_type, part,
            None if checkpoint is None else checkpoint.checkpoint, matches, skipped_by, halted_on_it,
        )  # fmt: skip

    def skip(
        self, name: str, message_ids: Sequence[UUID], record: Intervention
    ) -> builtins.list[int]:
        with self.transaction():
            targets = self.skip_targets(name, message_ids)
            check_skippable(name, targets)
            entry = self.record(record)
            subscriber_id = self.get(name).subscriber_id
            for t in targets:
                assert t.part is not None
                self.skipped.append(_Skipped(entry, subscriber_id, t.part, 1, t.message_id))
                self.store.skip_lists.setdefault((name, t.part), set()).add(t.message_id)
            for part in sorted({t.part for t in targets if t.part is not None}):
                self._skip_on_part(name, part, {t.message_id for t in targets})
        return resumed_parts(targets)

    def _skip_on_part(self, name: str, part: int, ids: set[UUID]) -> None:
        """A halt on one of ``ids`` is cleared; the version moves on (skip_on_part)."""
        state = self.store.get_part(name, part)
        halted = state.halted_error
        if self.store.halted_on.get((name, part)) in ids:
            self.store.halted_on[name, part] = None
            halted = None
        self.store._set(dataclasses.replace(state, halted_error=halted, version=state.version + 1))

    def record(self, intervention: Intervention) -> int:
        with self.store._lock:
            # Read back as from JSONB: plain JSON values.
            params = json.loads(json.dumps(intervention.params))
            self.store.ledger.append(dataclasses.replace(intervention, params=params))
            entry = len(self.store.ledger)
            self.recorded_at[entry] = datetime.now(UTC)
            return entry

    def ledger(self, name: str) -> builtins.list[Recorded]:
        with self.store._lock:
            numbered = builtins.list(enumerate(self.store.ledger, 1))
        return [self._recorded(n, i) for n, i in numbered if i.subscriber == name]

    def operator_skips(self, subscriber_id: UUID) -> builtins.list[OperatorSkip]:
        with self.store._lock:
            ledger, skipped = builtins.list(self.store.ledger), builtins.list(self.skipped)
        # As the query orders them: by entry, part, then message id (a range's none: last).
        mine = sorted(
            (k for k in skipped if k.subscriber_id == subscriber_id),
            key=lambda k: (k.entry, k.part, k.message_id is None, str(k.message_id)),
        )
        return [
            OperatorSkip(
                self._recorded(k.entry, ledger[k.entry - 1]),
                k.part,
                k.events,
                k.message_id,
                k.after,
                k.upto,
            )
            for k in mine
        ]

    def _recorded(self, entry: int, i: Intervention) -> Recorded:
        at = self.recorded_at.get(entry, datetime.fromtimestamp(0, UTC))
        return Recorded(
            entry, i.subscriber, i.subscriber_id, i.action, at, self.db_role,
            i.actor.os_user, i.actor.host, i.params, i.events,
        )  # fmt: skip


class InMemoryDefinitions(InMemoryInterventions):
    """A :class:`relay.core.ports.DefinitionStore`: the interventions' store, the writes
    of definitions as the Postgres store makes them (``add_all``, ``replace``), and the
    lag and skips of a subscriber's parts as its ``part_lag`` and ``part_skips`` queries
    read them. Positions here are all 1 (one per transaction): the lag's positions are
    each event's place in the outbox instead, as Postgres's identity sequence numbers
    its rows, so the lag estimated past a scan is the same."""

    def add_all(self, subscribers: Sequence[tuple[Subscriber, StartFrom]]) -> None:
        with self.transaction():
            for subscriber, start in subscribers:
                self.add(subscriber, start, replace=True)

    def replace(self, before: Subscriber, after: Subscriber) -> None:
        with self.transaction():
            check_unchanged(self.get(before.name).subscriber, before)
            self.add(after, replace=True)

    def index_parts(self) -> None:
        """Nothing to build: the in-memory store finds a part's events by scanning."""

    def lag_sample(self, state: PartState, scan: int) -> LagSample:
        subscriber = state.subscriber
        with self.store._lock:
            numbered = builtins.list(enumerate(self.store.events, 1))
            recorded = dict(self.store.recorded_at)
        after = [(n, e) for n, e in numbered if e.key > state.checkpoint][:scan]
        mine = [
            e
            for _, e in after
            if _part(e, subscriber.parts) == state.part and subscriber.matches(e)
        ]
        oldest = min((recorded[e.key] for e in mine), default=None)
        return LagSample(
            scanned=len(after),
            counted=len(mine),
            first_position=after[0][0] if after else None,
            last_position=numbered[-1][0] if numbered else None,
            age_s=None if oldest is None else time.time() - oldest,
        )

    def part_skips(self, name: str, scan: int | None) -> builtins.list[PartSkips]:
        state = self.get(name)
        horizon = Position(self.horizon(), 0)
        with self.store._lock:
            skipped = [k for k in self.skipped if k.subscriber_id == state.subscriber_id]
        found = []
        for part in state.parts:
            mine = [k for k in skipped if k.part == part.part]
            by_reset = sum(k.events for k in mine if k.message_id is None)
            by_skip = sum(k.events for k in mine if k.message_id is not None)
            beyond = part.checkpoint > horizon
            scanned, counted = self._jumped(state, part, scan) if beyond else (None, None)
            found.append(PartSkips(part.part, beyond, scanned, counted, by_reset, by_skip))
        return found

    def _jumped(self, state: SubscriberState, part: PartState, scan: int | None) -> tuple[int, int]:
        """The rows a checkpoint beyond the horizon jumped over: those at or before it,
        newest first, ``scan`` at most; and of them, the part's written since it was set."""
        subscriber = state.subscriber
        with self.store._lock:
            before = [e for e in reversed(self.store.events) if e.key <= part.checkpoint]
        rows = before if scan is None else before[:scan]
        counted = sum(
            1
            for e in rows
            if e.occurred_at >= part.updated_at
            and _part(e, subscriber.parts) == part.part
            and subscriber.matches(e)
        )
        return len(rows), counted


class _Skipped(NamedTuple):
    """One row of what an operator skipped (Postgres: outbox_skipped)."""

    entry: int
    subscriber_id: UUID
    part: int
    events: int
    message_id: UUID | None = None
    after: Position | None = None
    upto: Position | None = None


def _part(event: OutboxEvent, parts: int) -> int:
    return part_of(event.aggregate_id, parts) if parts > 1 else 0


@dataclasses.dataclass
class _Session:
    hostname: str
    pid: int
    expires_at: float  # on the store's clock


def part_of(aggregate_id: str, parts: int) -> int:
    """The in-memory store's part of an event: a stable hash of its aggregate id."""
    return zlib.crc32(aggregate_id.encode()) % parts


class InMemoryPublisher:
    """A :class:`relay.core.ports.Publisher` that stands for a broker and the part's producer:
    committed transactions in a list, and the Kafka-side checkpoint of each checkpoint
    generation beside them, as the transactional publisher keeps it.

    Two hooks stand for the world around the batch in flight: ``on_send`` runs as it is
    handed to the client (before ``meanwhile``: what happens elsewhere while it
    travels), and ``refuse`` is the broker's verdict on each transaction's records (it
    raises :class:`PoisonRecordError` for those the broker would refuse).
    """

    def __init__(self) -> None:
        self.transactions: list[list[KafkaRecord]] = []
        self.checkpoints: dict[str, KafkaCheckpoint] = {}
        self.on_send: Callable[[], None] | None = None
        self.refuse: Callable[[Sequence[KafkaRecord]], None] | None = None
        self.closed = False
        self._key_space: UUID | None = None

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        self._key_space = key_space
        return self.checkpoints.get(generation)

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        if self.on_send is not None:
            self.on_send()
        records, end, generation = batch.records, batch.end, batch.generation
        if records and not batch.may_extend:
            # As the real one: the batch commits as given while the callback runs.
            self._commit(records, end, generation, batch.dead_letters)
            if meanwhile is not None and meanwhile() is not None:
                raise AssertionError("meanwhile extended a batch after promising not to")
            return
        # As the real one: the callback runs while the records travel, and an
        # extension joins the transaction.
        extension = meanwhile() if meanwhile is not None else None
        if not records:  # no transaction: the Postgres checkpoint alone moves
            if extension is not None:
                self.publish(Batch(*extension, generation))
            return
        if extension is not None:
            records, end = [*records, *extension[0]], extension[1]
        self._commit(records, end, generation, batch.dead_letters)

    def _commit(
        self,
        records: Sequence[KafkaRecord],
        end: Position,
        generation: str,
        dead_letters: Sequence[tuple[Position, str]],
    ) -> None:
        if self.refuse is not None:
            self.refuse(records)
        # As the broker would refuse the tag (offset.metadata.max.bytes): the worker cuts
        # a batch whose dead letters it cannot name.
        assert dead_letter_tag.fitting(dead_letters) == len(dead_letters), "tag too long"
        self.transactions.append(list(records))
        last = records[-1].outbox_message_id
        self.checkpoints[generation] = KafkaCheckpoint(
            end,
            self._key_space,
            UUID(last) if last else None,
            dead_letter_tag.read(dead_letter_tag.fields(dead_letters)),  # as Kafka keeps them
        )

    def close(self) -> None:
        self.closed = True

    def published(self) -> list[KafkaRecord]:
        """Every committed record, in order."""
        return [record for transaction in self.transactions for record in transaction]


class InMemoryTopicRecord:
    """The outbox's record of its topics (``TopicRecord``), in memory. ``adopting``: as
    migration 0017 leaves an outbox that had published already."""

    def __init__(self, *, adopting: bool = False) -> None:
        self.origins: dict[str, TopicOrigin] = {}
        self._adopting = adopting
        self._lock = threading.Lock()

    def recorded(self) -> frozenset[str] | None:
        return frozenset(self.origins)

    def record(self, topics: Iterable[str], origin: TopicOrigin) -> None:
        with self._lock:
            for topic in topics:
                self.origins.setdefault(topic, origin)

    def reserve(self, topic: str, cap: int | None) -> bool | None:
        with self._lock:
            if topic not in self.origins:
                if cap is not None and self._rows() >= cap:
                    return False
                self.origins[topic] = TopicOrigin.ROW
            return True

    def release(self, topic: str) -> None:
        with self._lock:
            if self.origins.get(topic) is TopicOrigin.ROW:
                del self.origins[topic]

    def row_topics(self) -> int | None:
        return self._rows()

    def adoption_pending(self) -> bool:
        return self._adopting

    def adopt(self, topics: Iterable[str]) -> bool:
        with self._lock:
            if not self._adopting:
                return False
            self._adopting = False
            for topic in topics:
                self.origins.setdefault(topic, TopicOrigin.ADOPTED)
            return True

    def _rows(self) -> int:
        return sum(1 for origin in self.origins.values() if origin is TopicOrigin.ROW)


class InMemoryTopicReader:
    """A :class:`relay.core.ports.TopicReader` of what an :class:`InMemoryPublisher`
    committed: one partition per topic, offsets counted per topic."""

    def __init__(self, broker: InMemoryPublisher) -> None:
        self._broker = broker

    def read(
        self, topics: Sequence[str], progress: Progress | None = None
    ) -> Iterator[ConsumedRecord]:
        records = self._committed(topics)
        yield from records
        if progress is not None:
            progress(len(records), len(records))

    def follow(
        self, topics: Sequence[str], idle: float = 0.1, *, from_beginning: bool = True
    ) -> Generator[ConsumedRecord | None, None, None]:
        done = 0 if from_beginning else len(self._committed(topics))
        while True:
            records = self._committed(topics)
            if len(records) == done:
                time.sleep(idle)  # as a consumer's poll waits for one
                yield None
            yield from records[done:]
            done = len(records)

    def _committed(self, topics: Sequence[str]) -> list[ConsumedRecord]:
        offsets: dict[str, int] = {}
        records = []
        for record in self._broker.published():
            offset = offsets[record.topic] = offsets.get(record.topic, -1) + 1
            if record.topic in topics:
                records.append(_consumed(record, offset))
        return records


class InMemorySink:
    """A :class:`relay.core.ports.SinkReader` of the rows a consumer wrote: (message id,
    topic), a row written twice held twice; a row without a message id is not the relay's."""

    def __init__(self) -> None:
        self._rows: list[tuple[UUID | None, str]] = []

    def write(self, rows: Iterable[tuple[UUID | None, str]]) -> None:
        self._rows.extend(rows)

    def message_ids(self) -> Iterator[tuple[UUID, str]]:
        return ((mid, topic) for mid, topic in self._rows if mid is not None)


class InMemoryProjection:
    """A :class:`relay.core.ports.ProjectionReader` of rows set by key, projecting every
    event of ``aggregate_type``, keyed by its payload's ``key_field``."""

    def __init__(self, aggregate_type: str = "order", key_field: str = "order_id") -> None:
        self.aggregate_type, self.key_field = aggregate_type, key_field
        self.held: dict[str, Position] = {}
        self.quarantined: set[str] = set()

    def projects(self, aggregate_type: str, event_type: str) -> bool:
        return aggregate_type == self.aggregate_type

    @contextmanager
    def read(self) -> Iterator[ProjectionRead]:
        rows = (ProjectedRow(key, at) for key, at in self.held.items())
        yield ProjectionRead(set(self.quarantined), rows)


def _payload_field(event: OutboxEvent, field: str) -> str | None:
    """The payload's ``field`` as text, as Postgres's ``->>`` gives it (JSON text for a
    nested value)."""
    payload = event.payload
    if not isinstance(payload, dict) or payload.get(field) is None:
        return None
    value = payload[field]
    return value if isinstance(value, str) else json.dumps(value)


def _as_text(event: OutboxEvent) -> OutboxEvent:
    """``event`` with its payload as JSON text (bytes), as a pass-through fetch gives it:
    jsonb's spacing, which the standard library's default separators share."""
    if isinstance(event.payload, Unreadable):
        return event
    return event._replace(payload=json.dumps(event.payload, ensure_ascii=False).encode())


def _unless_too_large(event: OutboxEvent, limit: int) -> OutboxEvent:
    """``event``, or its identity only when it is larger than ``limit``, as the
    Postgres fetch returns a row too large for any record."""
    size = event.stored_bytes + sum(
        len(text.encode()) for text in (event.aggregate_type, event.aggregate_id, event.event_type)
    )
    if size <= limit:
        return event
    return event._replace(
        aggregate_type=_cut(event.aggregate_type),
        aggregate_id=_cut(event.aggregate_id),
        event_type=_cut(event.event_type),
        payload=Unreadable(f"too large to publish: the row holds {size} bytes", read=False),
        headers={},
        debezium=None,
    )


def _cut(text: str) -> str:
    size = len(text.encode())
    return text if size <= 200 else f"{text[:200]}...[cut: {size} bytes]"


def _consumed(record: KafkaRecord, offset: int) -> ConsumedRecord:
    """``record`` as a consumer reads it: header values are bytes on the wire."""
    headers = [(k, v.encode() if isinstance(v, str) else v) for k, v in record.headers]
    return ConsumedRecord(
        record.topic, 0, offset, record.key, record.value, headers, record.timestamp_ms
    )


def _is_a_daemon_store(store: InMemoryStore) -> DaemonStore:
    """mypy holds the in-memory store to the port here (Postgres's: relay.daemon)."""
    return store


def _is_a_topic_record(record: InMemoryTopicRecord) -> TopicRecord:
    """mypy holds the in-memory record to the port here (Postgres's: relay.daemon)."""
    return record


def _is_a_replay_ledger(ledger: InMemoryReplayLedger) -> ReplayLedger:
    """mypy holds the in-memory ledger to the port here (Postgres's: relay.wiring)."""
    return ledger


def _is_a_verify_outbox(outbox: InMemoryVerifyOutbox) -> VerifyOutbox:
    """mypy holds the in-memory verify outbox to the port here (Postgres's: relay.wiring)."""
    return outbox


def _is_an_intervention_store(store: InMemoryInterventions) -> InterventionStore:
    """mypy holds the in-memory interventions' store to the port here (Postgres's:
    relay.wiring)."""
    return store


def _is_a_definition_store(store: InMemoryDefinitions) -> DefinitionStore:
    """mypy holds the in-memory definitions' store to the port here (Postgres's:
    relay.wiring)."""
    return store


def _is_a_projection_reader(projection: InMemoryProjection) -> ProjectionReader:
    """mypy holds the in-memory projection to the port here (Postgres's: relay.wiring)."""
    return projection
