"""Subscriber and part status with their lag: one model, computed once per look, for
``outbox-relay status``, ``subscribers list``, ``verify`` and ``/metrics``.

The lag in events stays cheap on a huge backlog. Each part's rows after its checkpoint
are counted exactly up to :data:`EXACT_UP_TO` rows scanned (an index range scan that
stops there). Beyond that the count is an estimate, and says so: ``position`` comes
from one identity sequence, so the newest row's position minus the first pending
row's is about the number of rows between them (more when rolled-back inserts left
gaps), of which a part of a split subscriber holds the share it held in the scan.
Only rows the subscriber's filters match count: a subscriber of one aggregate type
has no lag from other types' rows. The lag in seconds is the time since the database
recorded the oldest of those rows (``recorded_at``, migration 0018), never a time a
writer chose (``occurred_at``): a row dated in the future cannot hide a backlog, nor one
dated 1970 fake one.

Events the operator skipped are counted apart (:class:`Skipped`): every reset forward's
range and every ``subscribers skip``, from the ledger (migration 0019), and a checkpoint
beyond the horizon, which would skip every row written from then on.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.core.ports import LagSample, LagStore, PartSkips, PartState, SubscriberState

# Rows after a checkpoint counted exactly, per part (a few milliseconds of index scan).
EXACT_UP_TO = 10_000


@dataclass(frozen=True)
class Lag:
    """How far publication is behind: in events, and in seconds since the database
    recorded the oldest pending event."""

    events: int
    seconds: float = 0.0
    estimated: bool = False  # events is an estimate (beyond EXACT_UP_TO)

    def __str__(self) -> str:
        return f"~{self.events}" if self.estimated else str(self.events)

    @classmethod
    def of(cls, sample: LagSample, exact_up_to: int = EXACT_UP_TO) -> Lag:
        seconds = max(0.0, sample.age_s or 0.0)
        if sample.scanned <= exact_up_to:
            return cls(sample.counted, seconds)
        first, last = sample.first_position or 0, sample.last_position or 0
        rows = max(sample.scanned, last - first + 1)
        share = round(rows * sample.counted / sample.scanned)
        return cls(max(sample.counted, share), seconds, estimated=True)

    @classmethod
    def total(cls, lags: list[Lag]) -> Lag:
        """Over several parts: the events summed, the oldest age."""
        return cls(
            sum(lag.events for lag in lags),
            max((lag.seconds for lag in lags), default=0.0),
            any(lag.estimated for lag in lags),
        )


@dataclass(frozen=True)
class Skipped:
    """Events of a part that the operator skipped: never published, by every reset
    forward (``by_reset``, with what a checkpoint beyond the horizon jumped over) and
    every ``subscribers skip`` (``by_skip``). ``at_least``: counted over the first rows
    only (a checkpoint beyond the horizon)."""

    events: int = 0
    at_least: bool = False
    beyond_horizon: bool = False  # the checkpoint sorts after rows yet to be written
    by_reset: int = 0
    by_skip: int = 0

    def __str__(self) -> str:
        return f"{self.events}+" if self.at_least else str(self.events)

    @classmethod
    def of(cls, sample: PartSkips, exact_up_to: int = EXACT_UP_TO) -> Skipped:
        scanned, counted = sample.scanned or 0, sample.counted or 0
        by_reset = counted + sample.by_reset
        return cls(
            by_reset + sample.by_skip,
            scanned > exact_up_to,
            sample.beyond_horizon,
            by_reset,
            sample.by_skip,
        )

    @classmethod
    def total(cls, skips: list[Skipped]) -> Skipped:
        return cls(
            sum(s.events for s in skips),
            any(s.at_least for s in skips),
            any(s.beyond_horizon for s in skips),
            sum(s.by_reset for s in skips),
            sum(s.by_skip for s in skips),
        )


@dataclass(frozen=True)
class PartStatus:
    state: PartState
    lag: Lag
    skipped: Skipped = Skipped()


@dataclass(frozen=True)
class SubscriberStatus:
    state: SubscriberState
    parts: list[PartStatus]

    @property
    def lag(self) -> Lag:
        return Lag.total([p.lag for p in self.parts])

    @property
    def skipped(self) -> Skipped:
        return Skipped.total([p.skipped for p in self.parts])


def part_lag(store: LagStore, state: PartState) -> Lag:
    return Lag.of(store.lag_sample(state, EXACT_UP_TO + 1))


def subscriber_statuses(
    store: LagStore, name: str | None = None, *, skips: bool = True
) -> list[SubscriberStatus]:
    """Every subscriber (or the one named), each part with its lag, and with what the
    operator skipped unless ``skips`` is False (one query less, where no one shows it)."""
    statuses = []
    for s in store.list(name):
        found = store.part_skips(s.subscriber.name, EXACT_UP_TO + 1) if skips else []
        skipped = {k.part: Skipped.of(k) for k in found}
        parts = [PartStatus(p, part_lag(store, p), skipped.get(p.part, Skipped())) for p in s.parts]
        statuses.append(SubscriberStatus(s, parts))
    return statuses


def subscriber_lag(store: LagStore, state: SubscriberState) -> Lag:
    """The lag of one subscriber over all its parts."""
    return Lag.total([part_lag(store, p) for p in state.parts])
