"""Cost growth with the backlog, and the relay's memory over a long run.

* Throughput draining a big backlog (10M rows at ``--scale full``) against a 1M-row
  one, each by one ``outbox-relay run`` process. If a poll cost grew with the backlog
  (a sort, a scan from the start), the big drain would be far slower per event. Both
  backlogs are written first, each followed by a CHECKPOINT and a pause; then the two
  drains alternate (bench/method.py), each through a new subscriber on an empty broker,
  clocked from the resume of its paused subscriber to its last checkpoint.
* EXPLAIN of the poll, half-way through the big backlog: an index range scan on the
  outbox's primary key, with no Sort node; and its execution time against the same
  poll on the small backlog.
* The relay's resident memory, sampled over the whole big drain: its peak (VmHWM),
  and its value at the start and the end of the drain (bounded: flat, not growing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg

from bench.harness import (
    BATCH,
    Drain,
    Figure,
    Scale,
    Stack,
    fill_outbox,
    fresh_subscribers,
    paused_drain,
)
from bench.method import Samples, interleave, settle
from relay.adapters.postgres.queries import queries_for
from relay.core.subscribers import Subscriber


def run(stack: Stack, scale: Scale) -> list[Figure]:
    small_url, big_url = stack.database("small"), stack.database("big")
    fill_outbox(small_url, scale.small_backlog)
    settle(small_url)
    fill_outbox(big_url, scale.growth_backlog)
    settle(big_url)
    small_plan = poll_plan(small_url, scale.small_backlog // 2)
    big_plan = poll_plan(big_url, scale.growth_backlog // 2)
    drains: dict[str, list[Drain]] = {"small": [], "big": []}

    def side(label: str, url: str, events: int) -> Callable[[], float]:
        def measure() -> float:
            drains[label].append(drain(stack, url, label))
            return events / drains[label][-1].seconds

        return measure

    def before_each() -> None:
        stack.fresh_broker()  # the big run's log would weigh on the next run
        settle(big_url)  # one cluster: a CHECKPOINT covers both databases

    rates = interleave(
        {"small": side("small", small_url, scale.small_backlog),
         "big": side("big", big_url, scale.growth_backlog)},
        scale.repetitions, before_each=before_each,
    )  # fmt: skip
    memory = _memory(drains["big"])
    big_label = f"{scale.growth_backlog / 1e6:g}M"
    small_label = f"{scale.small_backlog / 1e6:g}M"
    index_scan = big_plan["index_scan"] and not big_plan["sort"]
    cpu = {"cpu_small": [d.cpu for d in drains["small"]], "cpu_big": [d.cpu for d in drains["big"]]}
    return [
        Figure.of("growth", f"relay ev/s, {big_label} vs {small_label} backlog", rates["big"],
                  "ev/s", rates["small"], f"{scale.small_backlog:,} backlog", "ratio>=0.9", cpu),
        Figure("growth", "poll is an index range scan (1 = yes)", float(index_scan), "",
               target="value>=1", details=big_plan),
        Figure("growth", f"poll execution ms, {big_label} vs {small_label}", big_plan["ms"], "ms",
               small_plan["ms"], f"{scale.small_backlog:,} backlog"),
        Figure.of("growth", f"relay peak RSS over {big_label} events",
                  Samples(tuple(d.peak_rss_mb for d in drains["big"])), "MiB",
                  target="value<=300", details=memory),
    ]  # fmt: skip


def drain(stack: Stack, url: str, label: str) -> Drain:
    """Publish the whole backlog again, through a new subscriber, with one relay process."""
    topic = f"{stack.topic_prefix(label)}.orders"
    fresh_subscribers(url, [Subscriber("bench", topic=topic)])
    return paused_drain(stack, url, label, 1, batch_size=BATCH)


def _memory(drains: list[Drain]) -> dict[str, Any]:
    """The relay's memory over its big drains: flat within a drain, not growing."""
    samples = drains[-1].rss_mb
    quarter = max(1, len(samples) // 4)
    return {
        "peak_mb": max(d.peak_rss_mb for d in drains),
        "first_quarter_mean_mb": sum(samples[:quarter]) / quarter,
        "last_quarter_mean_mb": sum(samples[-quarter:]) / quarter,
        "samples": len(samples),
    }


def poll_plan(url: str, after: int, *, part: int = 0, parts: int = 1) -> dict[str, Any]:
    """EXPLAIN ANALYZE of the relay's poll (of ``part`` of ``parts``) from the
    ``after``-th row on; ``scanned`` counts the rows its scan read, its own or not."""
    query = queries_for("public")["fetch_batch"]
    with psycopg.connect(url, autocommit=True) as conn:
        tx, pos = conn.execute(
            "SELECT transaction_id::text::bigint, position FROM outbox o"
            " ORDER BY o.transaction_id, o.position OFFSET %s LIMIT 1",
            (after,),
        ).fetchone() or (0, 0)
        params = {
            "transaction_id": tx,
            "position": pos,
            "limit": BATCH,
            "max_bytes": 2**62,
            "max_row_bytes": 2**62,
            "part": part,
            "parts": parts,
            "aggregate_types": None,
            "event_types": None,
        }
        conn.execute(query, params).fetchall()  # warm the cache: measure the plan, not I/O
        explain = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query
        (document,) = conn.execute(explain, params).fetchone() or (None,)
    plan = (json.loads(document) if isinstance(document, str) else document)[0]
    nodes = list(_nodes(plan["Plan"]))
    return {
        "index_scan": any(
            n["Node Type"] in ("Index Scan", "Index Only Scan")
            and n.get("Index Name") == "outbox_pkey"
            for n in nodes
        ),
        # A sort of the backlog: one fed by the scan of the outbox itself (a sort of the
        # batch the poll has already cut, above its Limit, costs nothing that grows).
        "sort": any(
            n["Node Type"] == "Sort"
            and any(c.get("Relation Name") == "outbox" for c in n.get("Plans", []))
            for n in nodes
        ),
        "nodes": [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in nodes],
        "index_cond": next((n.get("Index Cond") for n in nodes if "Index Cond" in n), None),
        "ms": plan["Execution Time"],
        "others": sum(
            n.get("Rows Removed by Filter", 0) for n in nodes if n.get("Relation Name") == "outbox"
        ),
        "scanned": sum(
            n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)
            for n in nodes
            if n.get("Relation Name") == "outbox"
        ),
        "shared_buffers_hit": plan["Plan"].get("Shared Hit Blocks"),
    }


def _nodes(node: dict[str, Any]) -> Any:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)
