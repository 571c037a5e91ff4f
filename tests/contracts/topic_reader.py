"""The topic reader port's contract (``relay.core.ports.TopicReader``): what verify, the dev
view and the tests rely on when they read topics back. Held against the Kafka reader on
Apache Kafka (written by the transactional publisher) and against the in-memory reader
(of the in-memory publisher), so that what is read through one says something about the
other."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from contextlib import closing

import pytest

from relay.core.model import ConsumedRecord, KafkaRecord, Position
from relay.core.ports import Batch, Publisher, TopicReader
from relay.errors import PoisonRecordError

TOO_LARGE = 1_000_001  # bytes: beyond Kafka's default message.max.bytes


class TopicReaderContract:
    """Subclassed once per adapter, with ``publisher`` (taken over), ``reader`` and
    ``topics`` (names not used before)."""

    def test_reads_every_committed_record_in_order_with_its_headers(
        self, publisher: Publisher, reader: TopicReader, topics: list[str]
    ) -> None:
        first = [event(topics[0], key, n) for n, key in enumerate("abab", 1)]
        second = [event(topics[1], "c", 5), event(topics[0], "a", 6)]
        publisher.publish(Batch(first, Position(100, 4), "g"))
        publisher.publish(Batch(second, Position(100, 6), "g"))
        told: list[tuple[int, int]] = []
        records = list(reader.read(topics, lambda done, total: told.append((done, total))))
        assert sorted(r.message_id or "" for r in records) == sorted(
            r.outbox_message_id or "" for r in first + second
        )
        assert told[-1][0] == 6
        for key in (b"a", b"b", b"c"):
            mine = [r for r in records if r.key == key]
            assert len({(r.topic, r.partition) for r in mine}) == 1  # one key, one partition
            assert [r.offset for r in mine] == sorted(r.offset for r in mine)
            positions = [r.position or Position(0, 0) for r in mine]
            assert positions == sorted(positions) and Position(0, 0) not in positions
        by_id = {r.message_id: r for r in records}
        last = by_id[second[-1].outbox_message_id]
        assert (last.topic, last.key, last.value, last.position) == (
            topics[0],
            b"a",
            b'{"n":6}',
            Position(100, 6),
        )

    def test_a_topic_nothing_was_published_to_has_no_records(
        self, reader: TopicReader, topics: list[str]
    ) -> None:
        assert list(reader.read(topics[:1])) == []

    def test_an_aborted_transaction_is_never_read(
        self, publisher: Publisher, reader: TopicReader, topics: list[str]
    ) -> None:
        aborted = event(topics[0], "a", 1)
        too_large = KafkaRecord(topics[0], b"a", b"x" * TOO_LARGE, [])
        with pytest.raises(PoisonRecordError):
            publisher.publish(
                Batch([aborted], Position(100, 1), "g"), lambda: ([too_large], Position(100, 2))
            )
        committed = event(topics[0], "a", 3)
        publisher.publish(Batch([committed], Position(100, 3), "g"))
        assert [r.message_id for r in reader.read(topics[:1])] == [committed.outbox_message_id]

    def test_follow_reads_what_is_there_then_what_comes_and_new_topics(
        self, publisher: Publisher, reader: TopicReader, topics: list[str]
    ) -> None:
        before = event(topics[0], "a", 1)
        publisher.publish(Batch([before], Position(100, 1), "g"))
        later = event(topics[1], "b", 2)  # its topic does not exist yet
        seen: list[ConsumedRecord] = []
        idle = 0
        deadline = time.monotonic() + 60
        with closing(reader.follow(topics, idle=0.05)) as records:
            for record in records:
                assert time.monotonic() < deadline, f"read only {seen}"
                if record is None:
                    idle += 1
                    if seen and not any(r.topic == topics[1] for r in seen):
                        publisher.publish(Batch([later], Position(100, 2), "g"))
                    continue
                seen.append(record)
                if len(seen) == 2:
                    break
        assert [r.message_id for r in seen] == [before.outbox_message_id, later.outbox_message_id]
        assert idle > 0

    def test_follow_from_the_end_reads_only_what_comes_after(
        self, publisher: Publisher, reader: TopicReader, topics: list[str]
    ) -> None:
        before = event(topics[0], "a", 1)
        publisher.publish(Batch([before], Position(100, 1), "g"))
        after = event(topics[0], "a", 2)
        deadline = time.monotonic() + 60
        published = False
        with closing(reader.follow(topics[:1], idle=0.05, from_beginning=False)) as records:
            for record in records:
                assert time.monotonic() < deadline, "never read the record published after"
                if record is None:
                    if not published:  # the end is known by the first idle spell
                        publisher.publish(Batch([after], Position(100, 2), "g"))
                        published = True
                    continue
                assert record.message_id == after.outbox_message_id
                break


def event(topic: str, key: str, n: int) -> KafkaRecord:
    """A record as the encoder makes it for the event at key (100, n)."""
    headers: list[tuple[str, str | bytes | None]] = [
        ("id", str(uuid.uuid4()).encode()),
        ("transaction_id", b"100"),
        ("position", str(n).encode()),
    ]
    return KafkaRecord(topic, key.encode(), f'{{"n":{n}}}'.encode(), headers)


def refuse_oversized(records: Sequence[KafkaRecord]) -> None:
    for record in records:
        if record.byte_size() >= TOO_LARGE:
            raise PoisonRecordError(record, "record too large")
