"""``verify --through``'s comparison: the ids a sink holds against those the outbox
expects in it (missing, twice, not the outbox's), over an in-memory sink."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from uuid import UUID, uuid4

from relay.adapters.memory import InMemorySink
from relay.core.interventions import OperatorSkip
from relay.core.model import Position
from relay.core.ports import PublishedEvent, SubscriberState
from relay.core.subscribers import Subscriber
from relay.ops.verify_sink import SinkReport, compare_ids, place_held, verify_sink

A, B, C, D = (uuid4() for _ in range(4))


def test_a_sink_holding_each_expected_id_once_is_clean() -> None:
    compared = compare_ids({A: None, B: None}, [B, A])
    assert (compared.found, compared.missing, compared.twice, compared.outside) == (2, [], {}, [])


def test_an_id_not_held_is_missing_and_one_held_again_is_counted() -> None:
    compared = compare_ids({A: None, B: None, C: None}, [A, A, A, C])
    assert compared.found == 2
    assert compared.missing == [B]
    assert compared.twice == {A: 3}


def test_ids_not_expected_are_outside_once_each_and_twice_when_doubled() -> None:
    compared = compare_ids({A: None}, [A, D, D])
    assert compared.outside == [D]
    assert compared.twice == {D: 2}


class Outbox:
    """The events verify expects of subscriber s, and where other ids' rows lie."""

    def __init__(self, events: Sequence[UUID], rows: dict[UUID, str]) -> None:
        self._events, self._rows = events, rows

    def published_events(self, subscriber: Subscriber) -> Iterator[PublishedEvent]:
        for n, mid in enumerate(self._events):
            yield PublishedEvent(mid, Position(1, n), "order", "OrderPlaced", False, False, 0)

    def part_starts(self, name: str) -> list[tuple[int, Position]]:
        return []

    def placed(self, name: str, ids: Sequence[UUID]) -> dict[UUID, str]:
        return {mid: self._rows[mid] for mid in ids if mid in self._rows}


class Store:
    def list(self) -> list[SubscriberState]:
        return [SubscriberState(Subscriber("s", topic="orders"), UUID(int=1), [])]

    def operator_skips(self, subscriber_id: UUID) -> list[OperatorSkip]:
        return []


def test_the_report_names_what_is_missing_twice_and_not_the_outboxs() -> None:
    ahead, rolled_back = uuid4(), uuid4()
    sink = InMemorySink()
    sink.write([(A, "orders"), (A, "orders"), (ahead, "orders"), (rolled_back, "orders")])
    sink.write([(D, "elsewhere")])  # another topic's: not checked
    outbox = Outbox([A, B], {ahead: "ahead"})
    (report,) = verify_sink(Store(), outbox, sink, "archive")  # type: ignore[arg-type]
    assert report.topics == ["orders"]
    assert (report.expected, report.found, report.missing, report.twice) == (2, 1, 1, 1)
    assert (report.not_in_outbox, report.ahead) == (1, 1)
    assert report.examples == {
        "missing": [str(B)],
        "twice": [f"{A} (2 times)"],
        "not_in_outbox": [str(rolled_back)],
    }
    assert report.problems and report.as_dict()["verdict"] == "problems"


def test_a_sink_holding_exactly_the_expected_events_is_clean() -> None:
    sink = InMemorySink()
    sink.write([(A, "orders"), (B, "orders")])
    (report,) = verify_sink(Store(), Outbox([A, B], {}), sink, "archive")  # type: ignore[arg-type]
    assert not report.problems and report.verdict == "clean"
    assert (report.expected, report.found) == (2, 2)


def test_what_is_held_but_not_expected_is_placed_by_where_its_event_lies() -> None:
    """The one ladder both sink checks (ids, and a projection's rows) place by: each
    thing held counted, one event held twice counted twice; no id or no row: not in the
    outbox, returned in order for the examples."""
    ahead, before, filtered, gone = uuid4(), uuid4(), uuid4(), uuid4()
    rows = {ahead: "ahead", before: "before_start", filtered: "filtered"}
    report = SinkReport("s", "archive", ["orders"], [])
    held = [("a", ahead), ("b", before), ("c", gone), ("d", None), ("e", filtered), ("f", ahead)]
    assert place_held(Outbox([], rows), report, held) == ["c", "d"]  # type: ignore[arg-type]
    assert (report.ahead, report.outside_range, report.not_in_outbox) == (2, 2, 2)
