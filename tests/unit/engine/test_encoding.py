"""What the JSON value format puts on the wire, whatever the payload (no servers)."""

from __future__ import annotations

import json
import tracemalloc
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from relay.adapters.postgres.fetch_plan import load_row_json as _load_row_json
from relay.adapters.postgres.fetch_plan import payloads as _payloads
from relay.core.model import OutboxEvent, Unreadable
from relay.core.ports import DeadLetterDecision
from relay.core.subscribers import Subscriber, TopicGuard, ValueFormat
from relay.engine.encoding import RecordEncoder, headers_for
from relay.engine.poison import dead_letter_record
from relay.errors import EncodingError

JSON = Subscriber("s", topic="t", value_format=ValueFormat.JSON)


def event(payload: Any) -> OutboxEvent:
    return OutboxEvent(
        1, 1, uuid.uuid4(), "order", "k", None, "OrderPlaced", payload, {}, datetime.now(UTC)
    )


@pytest.mark.parametrize(
    "payload",
    [
        {"order_id": "o-1", "amount_cents": 1250, "note": "café ☕", "tags": [1.5, None, True]},
        {"big": 2**70, "negative": -(2**65)},  # beyond 64 bits: written all the same
        {"control": "\x00\u2028", "nested": [[[{"a": {}}]]]},
    ],
)
def test_a_json_value_is_compact_utf8_json_of_the_payload(payload: Any) -> None:
    value = RecordEncoder(None).encode(event(payload), JSON).value
    assert value is not None
    assert json.loads(value) == payload
    assert value == json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_json_value_holds_about_its_own_length_in_memory() -> None:
    """A batch keeps its records until its commit, and batch_max_bytes bounds them by
    their length: a small value must not hold a large buffer. (orjson 3.12+ returns each
    value in a 4 KiB buffer: 5,000 values of ~60 bytes held 20 MB.)"""
    encode = RecordEncoder(None).for_subscriber(JSON)
    events = [event({"order_id": f"o-{n}", "amount_cents": n}) for n in range(1000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        values = [encode(e).value for e in events]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    length = sum(len(v or b"") for v in values)
    # The records themselves (key, headers, tuple) hold a few hundred bytes each.
    assert held < length + 1000 * 1024, f"{held / len(values):.0f} bytes held per value"


def test_a_payload_too_deep_to_write_is_that_events_poison() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(EncodingError, match="cannot be written as JSON"):
        RecordEncoder(None).encode(event(deep), JSON)


def test_a_number_beyond_a_double_is_the_rows_poison_not_null() -> None:
    """Issue #27: jsonb's numeric holds 1e400 + 0.5, which the standard library loads as
    inf, and orjson wrote as null: the row's value silently changed."""
    huge = b'{"n": 1' + b"0" * 400 + b'.5, "m": 1}'
    loaded = _load_row_json(huge)
    assert isinstance(loaded, Unreadable) and "beyond a double" in str(loaded)
    with pytest.raises(EncodingError, match="beyond a double"):
        RecordEncoder(None).encode(event(loaded), JSON)
    # An integer that large is exact in Python: published as it is.
    exact = _load_row_json(b'{"n": 1' + b"0" * 400 + b"}")
    assert exact == {"n": 10**400}
    assert RecordEncoder(None).encode(event(exact), JSON).value == b'{"n":1' + b"0" * 400 + b"}"
    assert _load_row_json(b'{"n": -1.5e3}') == {"n": -1500.0}


def test_a_dead_letter_stays_small_whatever_the_row_holds() -> None:
    """Issue #27: a dead letter copied aggregate_id, event_type and headers whole, so a
    2 MB aggregate_id made the dead letter itself too large, halting the part."""
    row = event({"blob": "x" * 3_000_000})._replace(
        aggregate_type="t" * 2_000_000,
        aggregate_id="k" * 2_000_000,
        event_type="e" * 2_000_000,
        headers={"h": "v" * 2_000_000},
    )
    decision = DeadLetterDecision("dlq", "too large: " + "q" * 2_000_000)
    letter = dead_letter_record(row, JSON, decision)
    assert letter.byte_size() < 100_000
    document = json.loads(letter.value or b"")
    assert document["message_id"] == str(row.message_id) and document["position"] == 1
    assert document["aggregate_id"].endswith("...[cut: 2000000 bytes]")
    assert document["event_type"].endswith("...[cut: 2000000 bytes]")
    assert document["headers_omitted_bytes"] > 2_000_000
    assert document["payload_omitted_bytes"] > 3_000_000
    assert letter.header("id") == str(row.message_id).encode()


@pytest.mark.parametrize(
    "number", [10**23, 2**64, -(2**63) - 1, 123456789012345678901234567890, 10**300]
)
def test_an_integer_beyond_64_bits_is_published_exactly_not_as_a_float(number: int) -> None:
    """orjson loads integers beyond 64 bits (up to a double's range) as floats: 10**23
    was published as 1e+23. jsonb keeps them exact, so must the relay."""
    text = b'{"n": %d, "s": "x"}' % number
    for loaded in (_payloads([text, b'{"m": 1}'])[0], _load_row_json(text)):
        assert loaded == {"n": number, "s": "x"} and type(loaded["n"]) is int
        value = RecordEncoder(None).encode(event(loaded), JSON).value
        assert value == b'{"n":%d,"s":"x"}' % number


def test_a_subscriber_encoder_heads_each_record_with_its_own_event_s_identity() -> None:
    # The chosen encoder reuses the transaction's and the types' headers from one event
    # to the next: a batch that changes transaction or type mid-way gets each right.
    kinds = [(7, "OrderPlaced", "order"), (7, "OrderPaid", "order"), (8, "OrderPaid", "order"),
             (8, "Refund", "payment"), (7, "OrderPlaced", "order")]  # fmt: skip
    events = [
        OutboxEvent(tx, at, uuid.uuid4(), aggregate, "k", None, kind, {}, {}, datetime.now(UTC))
        for at, (tx, kind, aggregate) in enumerate(kinds)
    ]
    encode = RecordEncoder(None).for_subscriber(JSON)
    for e, record in zip(events, map(encode, events), strict=True):
        assert record.headers == headers_for(e)
        assert record.size == record._replace(size=-1).byte_size()


def mixed_batch() -> list[OutboxEvent]:
    """Transactions, types and aggregates that change mid-batch, a version, the row's own
    headers (one of them a name the relay reserves): what the batch loop must get right
    event by event."""
    kinds = [(7, "OrderPlaced", "order", None, {}), (7, "OrderPaid", "order", 3, {"a": "b"}),
             (8, "OrderPaid", "order", None, {"n": 1, "outbox.x": "y"}),
             (8, "Refund", "payment", 2, {}), (9, "OrderPlaced", "order", None, {})]  # fmt: skip
    now = datetime.now(UTC)
    return [
        OutboxEvent(tx, at, uuid.uuid4(), kind_of, f"k{at}", version, kind, {"at": at}, more, now)
        for at, (tx, kind, kind_of, version, more) in enumerate(kinds)
    ]


@pytest.mark.parametrize("topic", ["t", "events.{aggregate_type}.{event_type}"])
def test_a_batch_encoded_whole_gives_each_event_the_record_it_gets_alone(topic: str) -> None:
    subscriber = Subscriber("s", topic=topic, value_format=ValueFormat.JSON)
    events = mixed_batch()
    alone = [RecordEncoder(None).encode(e, subscriber) for e in events]
    encoder = RecordEncoder(None)
    for _ in range(2):  # and again, from the headers the first batch left cached
        assert encoder.for_batches(subscriber)(events) == alone
    assert [r.topic for r in alone][3] == ("t" if topic == "t" else "events.payment.Refund")


def test_a_batch_encoded_whole_asks_the_guard_of_every_topic_it_routes_to() -> None:
    # Asked once per topic per batch, not once for the batch: the fourth event's topic
    # (another subscriber's) is refused although the first three's was admitted.
    guard = TopicGuard("relay-checkpoints")
    routed = Subscriber("s", topic="events.{aggregate_type}", value_format=ValueFormat.JSON)
    guard.update([routed, Subscriber("other", topic="events.payment")])
    encoder = RecordEncoder(None, guard)
    events = mixed_batch()
    assert len(encoder.for_batches(routed)(events[:3])) == 3
    with pytest.raises(EncodingError, match=r"events\.payment"):
        encoder.for_batches(routed)(events)


def test_a_batch_with_an_unreadable_row_raises_for_the_slow_path_to_name_it() -> None:
    events = mixed_batch()
    events[2] = events[2]._replace(payload=Unreadable("not JSON", read=True))
    with pytest.raises(EncodingError, match=str(events[2].message_id)):
        RecordEncoder(None).for_batches(JSON)(events)
