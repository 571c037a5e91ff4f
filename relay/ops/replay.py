"""``subscribers replay``: republish a range of the outbox, exactly once, into a topic
of the operator's choice or the subscriber's own topics (docs/design.md §7, "Replay").

A replay is an intervention on the ledger (``outbox_interventions``, action
``replay``): its 'start' entry holds its arguments (the range, both ends included,
the filters that narrow the subscriber's, the topic) and the events of its range, and
its id names the replay everywhere else: the records carry it in the ``outbox.replay``
header, and the Kafka side is ``<kafka_id_prefix>.replay.<subscriber id>.<entry id>``.

Its progress is kept as the relay keeps a part's (§5): each batch is one Kafka
transaction under that ``transactional.id``, which commits, as the offsets of that
consumer group, the key of the last event it published (the cursor). A run begins with
``init_transactions`` (which fences any earlier run and aborts its open transaction),
then reads the cursor and goes on after it. So a run killed at any point, run again
with the same arguments, finds the open replay on the ledger (a 'start' without a
'done'), and publishes each event of the range once: what committed is behind the
cursor, and what did not commit was aborted. Postgres holds no cursor, so there is no
window between the two commits to mend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Protocol
from uuid import UUID

from relay.core.interventions import Action, Actor, Intervention
from relay.core.log_fields import log_extra
from relay.core.model import KafkaRecord, OutboxEvent, Position
from relay.core.ports import Batch, Fetched, ReplayLedger, Selection, SubscriberState
from relay.core.replay import HEADER_REPLAY, OpenReplay, ReplayRange
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, TopicGuard
from relay.errors import EncodingError, SubscriberError
from relay.ops.interventions import Confirm, Preview
from relay.ops.redrive import RedrivePublisher, RegistryEncoder, relay_encoder

logger = logging.getLogger(__name__)

# The checkpoint group's only generation: its committed offsets are the replay's cursor.
GENERATION = "cursor"
DEFAULT_BATCH = 500


class Fetcher(Protocol):
    """What a replay reads of the outbox (``OutboxStore.fetch``)."""

    def fetch(self, after: Position, selection: Selection) -> Fetched: ...


class ReplayOutbox(Fetcher, Protocol):
    """What ``subscribers replay`` reads and records of the outbox (the store port):
    the subscribers, the horizon, the ledger and the range's events."""

    def get(self, name: str) -> SubscriberState: ...

    def list(self, name: str | None = None) -> Sequence[SubscriberState]: ...

    def horizon(self) -> int: ...

    def record(self, intervention: Intervention) -> int: ...


# The exactly-once publisher of a replay (the composition root builds it): its
# ``transactional.id`` prefix, and the guard that confines the topics rows chose.
ReplayPublishers = Callable[[str, TopicGuard], RedrivePublisher]


class Replay:
    """One run of one replay: recover the cursor, then publish the rest of the range, a
    batch per Kafka transaction, each committing its last key as the cursor."""

    def __init__(
        self,
        outbox: Fetcher,
        publisher: RedrivePublisher,
        encode: Callable[[OutboxEvent], KafkaRecord],
        wanted: ReplayRange,
        entry: int,
        *,
        batch_size: int = DEFAULT_BATCH,
        max_bytes: int = 2**62,
        raw_payloads: bool = False,
    ) -> None:
        self._outbox = outbox
        self._publisher = publisher
        self._encode = encode
        self._wanted = wanted
        self._header = (HEADER_REPLAY, str(entry).encode())
        self._selection = wanted.selection(batch_size, max_bytes, raw_payloads=raw_payloads)
        self.published = 0
        self.resumed_after: Position | None = None

    def run(self) -> int:
        """Publish what the cursor has not passed; returns how many events."""
        cursor = self._publisher.recover(GENERATION)  # fences earlier runs first
        after = self._wanted.before_start()
        if cursor is not None:
            after = self.resumed_after = cursor.position
        end = self._wanted.end
        while after < end:
            fetched = self._outbox.fetch(after, self._selection)
            events = [e for e in fetched.events if e.key <= end]
            if events:
                records = [self._record(e) for e in events]
                self._publisher.publish(Batch(records, events[-1].key, GENERATION, False))
                self.published += len(events)
            if fetched.read_to is None or not fetched.full:
                break  # every decided row read; the range is below the horizon
            after = fetched.read_to
        return self.published

    def _record(self, event: OutboxEvent) -> KafkaRecord:
        try:
            record = self._encode(event)
        except EncodingError as exc:
            raise SubscriberError(
                f"event {event.message_id} at {event.key} cannot be replayed: {exc}; the "
                f"events before it are published (the replay stays open: run it again once "
                "the cause is fixed, or replay a range or filter that leaves it out)"
            ) from exc
        if self._wanted.into is not None:
            record = record._replace(topic=self._wanted.into)
        return record._replace(headers=[*record.headers, self._header], size=-1)


@dataclass(frozen=True)
class ReplayDone:
    """What ``subscribers replay`` did."""

    entry: int  # the replay's ledger entry (the header's value)
    events: int  # the events of its range, when it started
    published: int  # by this run
    resumed_after: Position | None  # an earlier run's cursor this run went on from
    resumed: bool  # it went on with an open replay
    now: int  # the events of its range now: fewer means rows were pruned meanwhile

    @property
    def pruned(self) -> int:
        return max(0, self.events - self.now)

    def as_dict(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "header": f"{HEADER_REPLAY}={self.entry}",
            "events": self.events,
            "published": self.published,
            "resumed": self.resumed,
            "resumed_after": None if self.resumed_after is None else str(self.resumed_after),
            "pruned": self.pruned,
        }


def replay_prefix(kafka_id_prefix: str, subscriber_id: UUID, entry: int) -> str:
    """The replay's ``transactional.id`` and consumer group prefix: per replay."""
    return f"{kafka_id_prefix}.replay.{subscriber_id}.{entry}"


def replay(
    settings: Settings,
    outbox: ReplayOutbox,
    replays: ReplayLedger,
    publishers: ReplayPublishers,
    name: str,
    asked: Callable[[Subscriber], ReplayRange],
    actor: Actor,
    confirm: Confirm,
    registry_encoder: RegistryEncoder,
    *,
    batch_size: int = DEFAULT_BATCH,
) -> ReplayDone | None:
    """``subscribers replay``: check the range (decided, a topic the subscriber may
    publish to), count it, preview, confirm; then start the replay on the ledger, or go
    on with the open one of the same arguments, publish the rest of it exactly once, and
    record that it is done. None when not confirmed. ``outbox``, ``replays``,
    ``publishers`` and ``registry_encoder`` are the composition root's
    (``relay.wiring``), on one connection."""
    state = outbox.get(name)
    wanted = asked(state.subscriber)
    subscribers = (s.subscriber for s in outbox.list())
    guard, encoder = relay_encoder(settings, subscribers, registry_encoder)
    _check(outbox, state, wanted, guard)
    with replays.exclusive(name, state.subscriber_id):
        found = replays.open(state.subscriber_id, wanted)
        events = replays.count(wanted) if found is None else found.events
        if not confirm(_preview(name, wanted, events, found)):
            return None
        entry = _record(outbox, state, wanted, actor, events, found)
        publisher = publishers(
            replay_prefix(settings.kafka_id_prefix, state.subscriber_id, entry), guard
        )
        publishing = wanted.publisher_of(state.subscriber)
        run = Replay(
            outbox,
            publisher,
            encoder.for_subscriber(publishing),
            wanted,
            entry,
            batch_size=batch_size,
            max_bytes=settings.batch_max_bytes,
            raw_payloads=publishing.publishing.raw_payloads,
        )
        with closing(publisher):
            run.run()
        now = replays.count(wanted)
        done = ReplayDone(entry, events, run.published, run.resumed_after, found is not None, now)
        params = {"replay": "done", "of": entry, "published": run.published, "events_now": now}
        outbox.record(Intervention(Action.REPLAY, name, state.subscriber_id, actor, params))
    if done.pruned:
        logger.warning(
            "replay %s of subscriber %s: %s event(s) of its range were pruned before it "
            "published them",
            entry,
            name,
            done.pruned,
            extra=log_extra(
                "replay_rows_pruned", subscriber=name, replay=entry, pruned=done.pruned
            ),
        )
    return done


def _check(
    outbox: ReplayOutbox, state: SubscriberState, wanted: ReplayRange, guard: TopicGuard
) -> None:
    """Refuse a range that is not decided yet (events could still be written into it,
    and the replay would not be the range's), and a topic the subscriber may not
    publish to (another's, the relay's own, one ``topic_allow`` refuses)."""
    name = state.subscriber.name
    horizon = Position(outbox.horizon(), 0)
    if wanted.end > horizon:
        raise SubscriberError(
            f"cannot replay up to {wanted.end}: transactions from {horizon.transaction_id} on "
            f"are still running or yet to begin, and may still write events into the range. "
            f"Replay up to {horizon} at most"
        )
    if wanted.into is not None and (refusal := guard.refusal(wanted.into, state.subscriber)):
        raise SubscriberError(f"subscriber {name!r} cannot replay into {wanted.into!r}: {refusal}")


def _preview(name: str, wanted: ReplayRange, events: int, found: OpenReplay | None) -> Preview:
    lines = [f"each record carries the header {HEADER_REPLAY}=<the replay's ledger entry>"]
    if found is not None:
        lines.insert(
            0,
            f"goes on with replay #{found.entry}, interrupted: it publishes only what that "
            "one did not (its cursor is read from Kafka)",
        )
    return Preview(
        Action.REPLAY,
        name,
        events,
        f"replay of subscriber {name!r}: publishes {events} event(s) AGAIN, {wanted.describe()}",
        tuple(lines),
    )


def _record(
    outbox: ReplayOutbox,
    state: SubscriberState,
    wanted: ReplayRange,
    actor: Actor,
    events: int,
    found: OpenReplay | None,
) -> int:
    """The replay's entry on the ledger: a new 'start', or a 'resume' of ``found``."""
    name = state.subscriber.name
    if found is not None:
        resumed = {"replay": "resume", "of": found.entry}
        outbox.record(Intervention(Action.REPLAY, name, state.subscriber_id, actor, resumed))
        return found.entry
    params = {"replay": "start", "args": wanted.args()}
    return outbox.record(
        Intervention(Action.REPLAY, name, state.subscriber_id, actor, params, events)
    )
