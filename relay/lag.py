"""Subscriber and part status with their lag: one model, computed once per look, for
``outbox-relay status``, ``subscribers list``, ``verify`` and ``/metrics``.

The lag in events stays cheap on a huge backlog. Each part's rows after its checkpoint
are counted exactly up to :data:`EXACT_UP_TO` rows scanned (an index range scan that
stops there). Beyond that the count is an estimate, and says so: ``position`` comes
from one identity sequence, so the newest row's position minus the first pending
row's is about the number of rows between them (more when rolled-back inserts left
gaps), of which a part of a split subscriber holds the share it held in the scan.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.ports import PartState
from relay.store import LagSample, OutboxStore, SubscriberState

# Rows after a checkpoint counted exactly, per part (a few milliseconds of index scan).
EXACT_UP_TO = 10_000


@dataclass(frozen=True)
class Lag:
    """How far publication is behind: in events, and in the oldest event's age."""

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
class PartStatus:
    state: PartState
    lag: Lag


@dataclass(frozen=True)
class SubscriberStatus:
    state: SubscriberState
    parts: list[PartStatus]

    @property
    def lag(self) -> Lag:
        return Lag.total([p.lag for p in self.parts])


def part_lag(store: OutboxStore, state: PartState) -> Lag:
    return Lag.of(store.lag_sample(state, EXACT_UP_TO + 1))


def subscriber_statuses(store: OutboxStore, name: str | None = None) -> list[SubscriberStatus]:
    """Every subscriber (or the one named), each part with its lag."""
    return [
        SubscriberStatus(s, [PartStatus(p, part_lag(store, p)) for p in s.parts])
        for s in store.list(name)
    ]


def subscriber_lag(store: OutboxStore, state: SubscriberState) -> Lag:
    """The lag of one subscriber over all its parts."""
    return Lag.total([part_lag(store, p) for p in state.parts])
