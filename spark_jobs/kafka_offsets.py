"""Offset arithmetic of the Kafka source, free of Spark and of any Kafka client.

Offsets have the built-in Kafka source's JSON shape, ``{"topic": {"partition":
next_offset}}``, so checkpoints read the same way in both. Offsets count log positions,
not records: transaction markers take offsets too, so ``maxOffsetsPerTrigger`` admits
slightly fewer records than offsets, as with Spark's own source.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# topic -> partition (a string, as in JSON) -> offset
Offsets = dict[str, dict[str, int]]
# topic -> partition -> (log start, log end)
Watermarks = dict[str, dict[str, tuple[int, int]]]

EARLIEST = -2  # in a startingOffsets JSON, as in Spark's Kafka source
LATEST = -1


class OffsetSpecError(ValueError):
    """A startingOffsets value that cannot be understood."""


def starting_offsets(spec: str, watermarks: Watermarks) -> Offsets:
    """Resolve ``earliest``, ``latest`` or a JSON spec against the current logs.

    Partitions the JSON leaves out start at ``latest``, as in Spark's source.
    """
    text = spec.strip()
    if text == "earliest":
        return {t: {p: lo for p, (lo, _) in parts.items()} for t, parts in watermarks.items()}
    if text == "latest":
        return {t: {p: hi for p, (_, hi) in parts.items()} for t, parts in watermarks.items()}
    try:
        requested = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OffsetSpecError(
            f"startingOffsets must be 'earliest', 'latest' or JSON such as "
            f'{{"topic": {{"0": 23, "1": -2}}}}; got {spec!r}'
        ) from exc
    if not isinstance(requested, dict) or not all(isinstance(v, dict) for v in requested.values()):
        raise OffsetSpecError(f"startingOffsets JSON must map topics to partitions: {spec!r}")
    offsets: Offsets = {}
    for topic, parts in watermarks.items():
        wanted = requested.get(topic, {})
        offsets[topic] = {}
        for partition, (low, high) in parts.items():
            value = int(wanted.get(partition, LATEST))
            offsets[topic][partition] = (
                low if value == EARLIEST else high if value == LATEST else value
            )
    return offsets


def advance(start: Offsets, latest: Offsets) -> Offsets:
    """Where a batch may end: the latest offsets, never behind ``start``. A partition
    that ``start`` does not know (new since the last batch) starts at offset 0."""
    return {
        t: {p: max(int(start.get(t, {}).get(p, 0)), hi) for p, hi in parts.items()}
        for t, parts in latest.items()
    }


def rate_limit(start: Offsets, end: Offsets, max_offsets: int) -> Offsets:
    """Cap a batch at ``max_offsets`` offsets, shared by partitions in proportion to
    their backlog; the remainder from rounding goes to the largest backlogs, so every
    batch makes progress even with a tiny limit."""
    backlog = {(t, p): hi - _at(start, t, p) for t, parts in end.items() for p, hi in parts.items()}
    total = sum(backlog.values())
    if total <= max_offsets:
        return end
    capped = {t: {p: _at(start, t, p) for p in parts} for t, parts in end.items()}
    budget = max_offsets
    largest_first = sorted(backlog.items(), key=lambda item: -item[1])
    for (t, p), lag in largest_first:
        share = min(lag, max_offsets * lag // total)
        capped[t][p] += share
        budget -= share
    for (t, p), _lag in largest_first:
        if budget <= 0:
            break
        extra = min(budget, end[t][p] - capped[t][p])
        capped[t][p] += extra
        budget -= extra
    return capped


def ranges(start: Offsets, end: Offsets) -> list[tuple[str, int, int, int]]:
    """``(topic, partition, from, until)`` for every partition with offsets to read."""
    found = []
    for topic, parts in sorted(end.items()):
        for partition, until in sorted(parts.items(), key=lambda item: int(item[0])):
            begin = _at(start, topic, partition)
            if until > begin:
                found.append((topic, int(partition), begin, until))
    return found


def _at(offsets: Mapping[str, Mapping[str, int]], topic: str, partition: str) -> int:
    return int(offsets.get(topic, {}).get(partition, 0))
