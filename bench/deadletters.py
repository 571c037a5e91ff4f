"""A flood of poison rows (issue #47, medium 6): how fast one part dead-letters a
backlog of poison rows, against how fast it publishes as many good ones.

One INSERT writes the backlog (20,000 rows, the issue's; 5,000 at ``quick``; 100,000 at
``full``), each row routed by its aggregate type to an illegal topic name under a
dead-letter subscriber of one part (JSON values, ``batch_size`` 5,000): every row is
poison and goes to the dead-letter topic. The baseline is the same number of good rows
under the same subscriber, in a database of their own: normal publishing. Both topics
and the dead-letter topic are created up front. Each side is one ``outbox-relay run``
process, clocked from the resume of its paused subscriber to its checkpoint at the last
row (``paused_drain``), interleaved (bench/method.py) after an emptied broker, a
CHECKPOINT and a pause; a side's subscriber is made afresh each round, which deletes
its dead letters.

With ``OUTBOX_BENCH_BASELINE_CODE`` naming a checkout of the code before (e.g. a
worktree of main), the same poison backlog is also dead-lettered by that checkout's
relay, interleaved: the before/after figure. (Before issue #47 that relay took 32 dead
letters a transaction; at ``default`` a round of it takes about 8 minutes.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg

from bench.harness import (
    BASELINE_CODE,
    BATCH,
    REPO,
    Figure,
    Scale,
    Stack,
    create_topics,
    fresh_subscribers,
    order_payload,
    paused_drain,
)
from bench.method import interleave, settle
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat

ROWS = {"quick": 5_000, "default": 20_000, "full": 100_000}
# Routed to '<prefix>.bad type': a space is not legal in a topic name.
POISON_TYPE = "bad type"


def run(stack: Stack, scale: Scale) -> list[Figure]:
    rows = ROWS.get(scale.name, ROWS["default"])
    prefix = stack.topic_prefix("deadletters")
    urls = {"poison": stack.database("deadletters_poison"),
            "good": stack.database("deadletters_good")}  # fmt: skip
    write_rows(urls["poison"], rows, POISON_TYPE)
    write_rows(urls["good"], rows, "order")
    sides = {"poison": (urls["poison"], REPO), "good": (urls["good"], REPO)}
    baseline = os.environ.get(BASELINE_CODE)
    if baseline:
        sides["poison before"] = (urls["poison"], Path(baseline))
    seconds: dict[str, list[float]] = {name: [] for name in sides}

    def side(name: str) -> float:
        url, code = sides[name]
        label = "deadletters-" + name.replace(" ", "-")
        fresh_subscribers(url, [subscriber(prefix)])
        drain = paused_drain(stack, url, label, 1, code=code, batch_size=BATCH)
        seconds[name].append(drain.seconds)
        return rows / drain.seconds

    def before_each() -> None:
        stack.fresh_broker()
        create_topics(stack.bootstrap, [f"{prefix}.order", f"{prefix}.dead"], 1)
        for url in urls.values():
            settle(url)

    rates = interleave({name: (lambda n=name: side(n)) for name in sides},
                       scale.repetitions, before_each=before_each)  # fmt: skip
    details = {"rows": rows, "batch_size": BATCH, "seconds": seconds}
    figures = [
        Figure.of("deadletters", f"dead-lettered rows/s, {rows:,} poison rows of one INSERT",
                  rates["poison"], "rows/s", rates["good"],
                  "the same number of good rows published", None, details),
    ]  # fmt: skip
    if baseline:
        before = Figure.of("deadletters", "dead-lettered rows/s, this relay vs the code before",
                           rates["poison"], "rows/s", rates["poison before"],
                           f"relay of {baseline}", "ratio>=1.0", details)  # fmt: skip
        figures.append(before)
    return figures


def subscriber(prefix: str) -> Subscriber:
    return Subscriber(
        "flood", topic=prefix + ".{aggregate_type}", value_format=ValueFormat.JSON,
        on_poison=PoisonPolicy.DEAD_LETTER, dead_letter_topic=prefix + ".dead",
    )  # fmt: skip


def write_rows(url: str, rows: int, aggregate_type: str) -> None:
    """``rows`` rows in one INSERT, as a writer's single statement; keys spread."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT %s, 'k' || g, 'OrderPlaced', %s::jsonb"
            "   FROM generate_series(1, %s) AS g",
            (aggregate_type, json.dumps(order_payload()), rows),
        )
        conn.execute("ANALYZE outbox")
