"""`topics tail`'s loop (relay/ops/tail.py) over the in-memory broker: where it starts,
when it stops, and what it shows of a record."""

from __future__ import annotations

import threading

from relay.adapters.memory import InMemoryPublisher, InMemoryTopicReader
from relay.core.model import KafkaRecord, Position
from relay.core.ports import Batch
from relay.core.value_decoding import Decoded, decode
from relay.ops.tail import header_text, tail


def publish(broker: InMemoryPublisher, value: bytes, n: int) -> None:
    record = KafkaRecord("t", b"k", value, [("event_type", b"OrderPlaced"), ("raw", b"\xff")])
    broker.publish(Batch([record], Position(1, n), "g"))


def plain(data: bytes | None) -> Decoded:
    return decode(data, None, None)


def test_from_the_beginning_it_shows_what_is_there_and_stops_at_the_limit() -> None:
    broker = InMemoryPublisher()
    for n in range(3):
        publish(broker, b'{"n": %d}' % n, n + 1)
    shown = list(tail(InMemoryTopicReader(broker), ["t"], plain, from_beginning=True, limit=2))
    assert [r.value.content for r in shown] == [{"n": 0}, {"n": 1}]
    first = shown[0].as_dict()
    assert first["key"] == {"encoding": "text", "content": "k"}
    assert first["headers"] == [["event_type", "OrderPlaced"], ["raw", "base64:/w=="]]
    assert (first["topic"], first["partition"], first["offset"]) == ("t", 0, 0)


def test_by_default_it_shows_only_what_comes() -> None:
    broker = InMemoryPublisher()
    publish(broker, b'"before"', 1)
    later = threading.Timer(0.3, publish, (broker, b'"after"', 2))
    later.start()
    try:
        shown = list(tail(InMemoryTopicReader(broker), ["t"], plain, limit=1, idle_timeout=60))
    finally:
        later.join()
    assert [r.value.content for r in shown] == ["after"]


def test_it_stops_after_the_idle_timeout_without_a_record() -> None:
    broker = InMemoryPublisher()
    publish(broker, b'"before"', 1)
    assert list(tail(InMemoryTopicReader(broker), ["t"], plain, idle_timeout=0.3)) == []


def test_a_limit_of_zero_reads_nothing() -> None:
    broker = InMemoryPublisher()
    publish(broker, b"1", 1)
    assert list(tail(InMemoryTopicReader(broker), ["t"], plain, limit=0)) == []


def test_a_header_without_a_value_stays_none() -> None:
    assert header_text(None) is None and header_text(b"x") == "x"
