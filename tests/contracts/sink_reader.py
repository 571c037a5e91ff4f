"""The contract of a consumer's sink read back (``relay.core.ports.SinkReader``, for
``verify --through``): each committed row's message id and topic, a row held twice given
twice, rows that are not the relay's left out. Held against the archive's reader
(relay.adapters.sinks.archive) and the in-memory sink."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from uuid import UUID, uuid4

from relay.core.ports import SinkReader

# A sink holding ``rows`` (message id or None, topic), committed: one batch per list.
Batches = Sequence[Sequence[tuple[UUID | None, str]]]
SinkWith = Callable[[Batches], SinkReader]


class SinkReaderContract:
    """Subclassed once per adapter, with a ``sink_with`` fixture."""

    def test_gives_each_row_once(self, sink_with: SinkWith) -> None:
        a, b, c = uuid4(), uuid4(), uuid4()
        sink = sink_with([[(a, "t.1"), (b, "t.2")], [(c, "t.1")]])
        assert sorted(sink.message_ids()) == sorted([(a, "t.1"), (b, "t.2"), (c, "t.1")])

    def test_gives_a_row_held_twice_twice(self, sink_with: SinkWith) -> None:
        a = uuid4()
        sink = sink_with([[(a, "t.1")], [(a, "t.1")]])
        assert list(sink.message_ids()) == [(a, "t.1"), (a, "t.1")]

    def test_leaves_out_rows_without_a_message_id(self, sink_with: SinkWith) -> None:
        a = uuid4()
        sink = sink_with([[(None, "t.1"), (a, "t.1")]])
        assert list(sink.message_ids()) == [(a, "t.1")]

    def test_an_empty_sink_holds_nothing(self, sink_with: SinkWith) -> None:
        assert list(sink_with([]).message_ids()) == []
