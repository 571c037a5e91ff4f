"""An event as the fetch reads it (FetchedEvent, issue #53) is, read through its fields'
names, the event it was written as: for the encoder, the poison policy and the latency
histogram alike (no servers; tests/integration/test_fetch_plan.py reads real rows)."""

from __future__ import annotations

import json
import pickle
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from relay.core.model import PG_EPOCH, FetchedEvent, OutboxEvent
from relay.core.ports import DeadLetterDecision
from relay.core.subscribers import Subscriber, ValueFormat
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import dead_letter_record
from relay.observability.latency import ages_of

AT = datetime(2026, 12, 4, 20, 31, 7, 123456, tzinfo=UTC)
BEFORE_2000 = datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def typed(at: datetime = AT) -> OutboxEvent:
    return OutboxEvent(7, 3, uuid.uuid4(), "order", "k", 2, "Placed", {"n": 1}, {"h": "v"}, at, 10)


def as_fetched(event: OutboxEvent) -> FetchedEvent:
    """``event`` as the fetch builds it from binary columns."""
    micros = (event.occurred_at - PG_EPOCH) // timedelta(microseconds=1)
    raw = (*event[:2], event.message_id.bytes, *event[3:9], micros, *event[10:])
    return FetchedEvent(*raw)


@pytest.mark.parametrize("at", [AT, BEFORE_2000, PG_EPOCH], ids=["2026", "1999", "2000"])
def test_a_fetched_events_id_and_time_read_as_written(at: datetime) -> None:
    written = typed(at)
    fetched = as_fetched(written)
    assert isinstance(fetched, OutboxEvent)
    assert (fetched.message_id, fetched.occurred_at) == (written.message_id, at)
    assert fetched.occurred_at.utcoffset() == timedelta(0)
    assert fetched.key == written.key and fetched.payload == written.payload
    changed = fetched._replace(payload={"n": 2})  # as the poison policy and envelopes do
    assert (changed.message_id, changed.occurred_at) == (written.message_id, at)
    assert pickle.loads(pickle.dumps(fetched)).occurred_at == at


@pytest.mark.parametrize(
    "subscriber",
    [
        Subscriber("s", topic="t", value_format=ValueFormat.JSON),
        Subscriber(
            "s",
            topic="t",
            value_format=ValueFormat.JSON,
            key="{message_id}",
            placements=("occurred_at:header", "message_id:envelope", "occurred_at:envelope"),
        ),
    ],
    ids=["default routing", "routed by id and time"],
)
def test_a_fetched_event_encodes_as_the_event_written(subscriber: Subscriber) -> None:
    written = typed()
    encoder = RecordEncoder(None)
    assert encoder.encode(as_fetched(written), subscriber) == encoder.encode(written, subscriber)
    assert encoder.for_batches(subscriber)([as_fetched(written)]) == [
        encoder.encode(written, subscriber)
    ]


def test_a_fetched_events_dead_letter_is_the_written_events() -> None:
    written, subscriber = typed(), Subscriber("s", topic="t", value_format=ValueFormat.JSON)
    decision = DeadLetterDecision("dlq", "refused")
    letter = dead_letter_record(as_fetched(written), subscriber, decision)
    assert letter == dead_letter_record(written, subscriber, decision)
    document = json.loads(letter.value or b"")
    assert document["message_id"] == str(written.message_id)
    assert document["occurred_at"] == "2026-12-04T20:31:07.123456+00:00"


def test_the_latency_of_fetched_events_is_that_of_the_events_written() -> None:
    now = AT + timedelta(seconds=90, microseconds=5)
    written = [typed(AT), typed(BEFORE_2000), typed(now + timedelta(hours=1))]
    fetched = [as_fetched(e) for e in written]
    assert ages_of(fetched, now) == ages_of(written, now)
    assert ages_of(fetched, now) == [
        90_000_005,
        (now - BEFORE_2000) // timedelta(microseconds=1),
        0,  # a time ahead of the relay's clock counts as 0
    ]
    mixed = [fetched[0], written[1]]  # a batch of both kinds: each read by its name
    assert ages_of(mixed, now) == ages_of(written[:2], now)
