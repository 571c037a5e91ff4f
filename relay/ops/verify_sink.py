"""``outbox-relay verify --through SINK PATH``: a consumer's sink against the outbox.

Verify checks the topics; past them, a consumer (the Spark archive) writes its own
sink, and a crash there can leave events missing or doubled that the topics never
show. For each subscriber, the events verify expects on its topics (up to each part's
checkpoint, as :func:`relay.ops.verify.expectations` finds them) that the sink's topics
carry must be in the sink exactly once. Reported: *missing* (expected, not held),
*twice* (held more than once, with the counts) and *not in outbox* (held, but no
committed event of the outbox has the id: a rolled-back transaction's, a foreign
record, or a row pruned since). Ids the sink holds past a checkpoint (published, not
yet checkpointed) or outside the subscriber's range are counted apart, not as errors.
A replayed event (``subscribers replay``) is archived again, so it counts as twice.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any, ClassVar, Protocol, TypeVar
from uuid import UUID

from relay.core.ports import SinkReader, VerifyOutbox
from relay.ops.verify import VerifyStore, expectations, placements, selected

MAX_EXAMPLES = 10  # ids listed per kind; the counts are always complete

_Held = TypeVar("_Held")


@dataclass(frozen=True)
class IdComparison:
    """What a sink holds of the ids expected in it."""

    found: int  # expected ids held (once or more)
    missing: list[UUID]
    twice: dict[UUID, int]  # ids held more than once: how many times
    outside: list[UUID]  # held, not expected (each once)


def compare_ids(expected: Collection[UUID], held: Iterable[UUID]) -> IdComparison:
    """Compare the ids expected in a sink with those it holds (a row each)."""
    counts = Counter(held)
    return IdComparison(
        found=sum(1 for mid in expected if mid in counts),
        missing=[mid for mid in expected if mid not in counts],
        twice={mid: n for mid, n in counts.items() if n > 1},
        outside=[mid for mid in counts if mid not in expected],
    )


@dataclass
class SinkFindings:
    """What a ``verify --through`` check found of one subscriber in one sink: counts
    (the subclass's fields), those in ``PROBLEMS`` problems, examples of each kind."""

    PROBLEMS: ClassVar[tuple[str, ...]] = ()
    subscriber: str
    sink: str
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list), kw_only=True)

    @property
    def problems(self) -> bool:
        return any(getattr(self, name) for name in self.PROBLEMS)

    @property
    def verdict(self) -> str:
        return "problems" if self.problems else "clean"

    def example(self, kind: str, text: str) -> None:
        if len(self.examples[kind]) < MAX_EXAMPLES:
            self.examples[kind].append(text)

    def as_dict(self) -> dict[str, Any]:
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "examples"}
        return {
            **counts,
            "problems": self.problems,
            "verdict": self.verdict,
            "examples": dict(self.examples),
        }


@dataclass
class SinkReport(SinkFindings):
    PROBLEMS: ClassVar[tuple[str, ...]] = ("missing", "twice", "not_in_outbox")
    topics: list[str]  # the subscriber's topics the sink holds: those checked
    topics_not_in_sink: list[str]  # the subscriber's topics the sink holds none of
    expected: int = 0
    found: int = 0
    missing: int = 0
    twice: int = 0
    not_in_outbox: int = 0  # no committed event of the outbox has the id
    ahead: int = 0  # published past the checkpoint: not yet expected
    outside_range: int = 0  # before the part's start or outside the subscriber's filters


def verify_sink(
    store: VerifyStore,
    outbox: VerifyOutbox,
    sink: SinkReader,
    sink_name: str,
    *,
    subscribers: Sequence[str] | None = None,
) -> list[SinkReport]:
    """One report per subscriber (all of them unless ``subscribers`` names some); the
    sink is read once."""
    held: dict[str, list[UUID]] = defaultdict(list)
    for mid, topic in sink.message_ids():
        held[topic].append(mid)
    reports = []
    for state in selected(store, subscribers):
        skips = store.operator_skips(state.subscriber_id)
        verified, expected = expectations(outbox, state, skips)
        topics = sorted(expected.topics & held.keys())
        report = SinkReport(
            verified.subscriber, sink_name, topics, sorted(expected.topics - held.keys())
        )
        # A dict: the outbox's order for the examples, and quick to look ids up in.
        wanted = {UUID(bytes=m): None for m, t in expected.topic_of.items() if t in held}
        compared = compare_ids(wanted, chain.from_iterable(held[t] for t in topics))
        _count(report, len(wanted), compared)
        _place(outbox, report, compared.outside)
        reports.append(report)
    return reports


def _count(report: SinkReport, expected: int, compared: IdComparison) -> None:
    report.expected, report.found = expected, compared.found
    report.missing, report.twice = len(compared.missing), len(compared.twice)
    for mid in compared.missing:
        report.example("missing", str(mid))
    for mid, times in compared.twice.items():
        report.example("twice", f"{mid} ({times} times)")


def _place(outbox: VerifyOutbox, report: SinkReport, outside: list[UUID]) -> None:
    """Count the ids held but not expected by where their rows lie."""
    for mid in place_held(outbox, report, [(mid, mid) for mid in outside]):
        report.example("not_in_outbox", str(mid))


class Placing(Protocol):
    """A report of a sink that counts what the sink holds but verify did not expect,
    by where its event lies for the subscriber."""

    subscriber: str
    ahead: int
    outside_range: int
    not_in_outbox: int


def place_held(
    outbox: VerifyOutbox, report: Placing, held: Sequence[tuple[_Held, UUID | None]]
) -> list[_Held]:
    """Count each thing held but not expected (with its event's id; None: no event of
    the outbox's) by where the event's row lies: past a checkpoint (*ahead*), outside the
    subscriber's range, or no row (*not in outbox*, not the outbox's committed event).
    Returns those not in the outbox, in order, for the examples."""
    ids = list(dict.fromkeys(mid for _, mid in held if mid is not None))
    where = dict(placements(outbox, report.subscriber, ids))
    not_in_outbox = []
    for thing, mid in held:
        placed = None if mid is None else where.get(mid)
        if placed == "ahead":
            report.ahead += 1
        elif placed is not None:
            report.outside_range += 1
        else:
            report.not_in_outbox += 1
            not_in_outbox.append(thing)
    return not_in_outbox
