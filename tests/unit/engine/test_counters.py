"""The part workers' counters (#34 item 5): each is declared once, on ``WorkerStats``
with its metric name and help text, and /metrics exports every one of them, per part,
from what the daemon sums; each changes under the statistics' lock (scrapes read them
from another thread)."""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from types import SimpleNamespace
from typing import Any

import relay.engine.batch_publisher
import relay.engine.worker
from relay.core.model import PartId
from relay.core.worker_stats import COUNTERS, WorkerStats
from relay.daemon import metrics
from relay.daemon.parts import _counts
from relay.observability.tracing import TracingHook

PART = PartId("orders", 2)

# What dashboards and alerts query: renaming one breaks them.
EXPORTED = {
    "outbox_relay_published_events",
    "outbox_relay_published_bytes",
    "outbox_relay_batches",
    "outbox_relay_errors",
    "outbox_relay_dead_lettered_events",
    "outbox_relay_recoveries",
    "outbox_relay_recoveries_refused",
    "outbox_relay_poison_events",
    "outbox_relay_poison_warnings_sampled_out",
    "outbox_relay_unexpected_errors",
    "outbox_relay_worker_failures",
    "outbox_relay_producers_opened",
}


class OnePart:
    """A relay running one part, whose worker's statistics are ``stats``."""

    def __init__(self, stats: WorkerStats) -> None:
        self.worker = SimpleNamespace(stats=stats, hook=TracingHook())

    def part_totals(self) -> dict[PartId, Counter[str]]:
        return {PART: _counts(self.worker)}  # type: ignore[arg-type]

    def part_states(self) -> dict[PartId, str]:
        return {PART: "running"}

    def part_waits(self) -> dict[PartId, str]:
        return {}

    def key_space_changes(self) -> Counter[str]:
        return Counter()

    def retention_totals(self) -> Counter[str]:
        return Counter()


def exported(stats: WorkerStats) -> dict[str, Any]:
    collector = metrics.RelayCollector(OnePart(stats), lambda: None)  # type: ignore[arg-type,return-value]
    return {family.name: family for family in collector._counters()}


def test_every_declared_counter_is_exported_by_metrics_with_its_value() -> None:
    stats = WorkerStats()
    for value, name in enumerate(COUNTERS, start=1):
        setattr(stats, name, value)
    families = exported(stats)
    for value, (name, (metric, help_text)) in enumerate(COUNTERS.items(), start=1):
        family = families[metric]
        assert (family.type, family.documentation) == ("counter", help_text), name
        [sample] = [s for s in family.samples if s.name == f"{metric}_total"]
        assert sample.labels == {"subscriber": "orders", "part": "2"}
        assert sample.value == value, name
    assert {metric for metric, _ in COUNTERS.values()} == EXPORTED


def test_the_counts_the_daemon_sums_are_every_declared_counter() -> None:
    counts = WorkerStats().counts()
    assert set(COUNTERS) <= set(counts)
    assert {"key_space_rebased", "key_space_continued"} <= set(counts)


def _locked(node: ast.AST) -> bool:
    return isinstance(node, ast.With) and any(
        ast.unparse(item.context_expr) == "self.stats.lock" for item in node.items
    )


def _unlocked_changes(tree: ast.AST, counted: set[str], locked: bool = False) -> list[int]:
    """The lines where ``self.stats.<a count>`` changes outside ``with self.stats.lock``."""
    found = []
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.AugAssign | ast.Assign) and not locked:
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            found += [
                child.lineno
                for target in targets
                if isinstance(target, ast.Attribute)
                and ast.unparse(target.value) == "self.stats"
                and target.attr in counted
            ]
        found += _unlocked_changes(child, counted, locked or _locked(child))
    return found


def test_every_count_changes_under_the_statistics_lock() -> None:
    """A ``+=`` is a read and a write: unlocked, a scrape's :meth:`WorkerStats.counts`
    may see the counts of a batch half updated, and two threads may lose an increment."""
    counted = set(WorkerStats().counts())
    for module in (relay.engine.worker, relay.engine.batch_publisher):
        tree = ast.parse(inspect.getsource(module))
        assert _unlocked_changes(tree, counted) == []
