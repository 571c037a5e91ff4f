"""The contract of the outbox's record of its topics (``relay.core.ports.TopicRecord``,
issue #47): what the topic creator relies on to confine the topics rows choose and to
count them against max_created_topics. Held against Postgres (``outbox_topics``, as the
relay role) and the in-memory record."""

from __future__ import annotations

import threading
from collections.abc import Callable

from relay.core.ports import TopicOrigin, TopicRecord

# The record of a new outbox; adopting=True: as migration 0017 leaves an outbox that
# had published. ``handles``: as many records on that one outbox (as several relays).
NewRecord = Callable[..., TopicRecord]
Handles = Callable[[int], list[TopicRecord]]


class TopicRecordContract:
    """Subclassed once per adapter, with ``new_record`` and ``handles`` fixtures."""

    def test_records_what_it_is_told_once(self, new_record: NewRecord) -> None:
        record = new_record()
        assert record.recorded() == frozenset()
        record.record(["a", "b"], TopicOrigin.DECLARED)
        record.record(["b", "c"], TopicOrigin.ROW)  # b stays declared
        assert record.recorded() == {"a", "b", "c"}
        assert record.row_topics() == 1

    def test_reserves_rows_topics_up_to_the_cap_and_never_counts_the_operators(
        self, new_record: NewRecord
    ) -> None:
        record = new_record()
        record.record(["fixed.1", "fixed.2", "fixed.3"], TopicOrigin.DECLARED)
        assert record.reserve("row.1", 2) is True
        assert record.reserve("row.1", 2) is True  # recorded already: no room taken
        assert record.reserve("row.2", 2) is True
        assert record.reserve("row.3", 2) is False
        assert record.reserve("fixed.1", 2) is True  # the operator's: recorded
        assert record.row_topics() == 2
        record.release("row.2")  # the broker refused it for good
        record.release("fixed.1")  # not a row's: kept
        assert record.reserve("row.3", 2) is True
        assert record.reserve("row.4", None) is True  # no cap
        assert record.recorded() == {"fixed.1", "fixed.2", "fixed.3", "row.1", "row.3", "row.4"}

    def test_relays_reserving_at_once_never_pass_the_cap(self, handles: Handles) -> None:
        records = handles(4)  # as four relays on one outbox
        granted: list[str] = []
        start = threading.Barrier(len(records))

        def reserve(record: TopicRecord, n: int) -> None:
            start.wait()
            for i in range(10):
                if record.reserve(f"t{n}.{i}", 5):
                    granted.append(f"t{n}.{i}")

        threads = [threading.Thread(target=reserve, args=(r, n)) for n, r in enumerate(records)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(granted) == 5
        assert records[0].row_topics() == 5

    def test_adopts_once_and_only_when_asked(self, new_record: NewRecord) -> None:
        fresh = new_record()
        assert fresh.adoption_pending() is False
        assert fresh.adopt(["x"]) is False
        assert fresh.recorded() == frozenset()
        upgraded = new_record(adopting=True)
        assert upgraded.adoption_pending() is True
        assert upgraded.adopt(["old.a", "old.b"]) is True
        assert upgraded.adopt(["late"]) is False  # another relay came first
        assert upgraded.adoption_pending() is False
        assert upgraded.recorded() == {"old.a", "old.b"}
        assert upgraded.row_topics() == 0  # adopted topics use no room
