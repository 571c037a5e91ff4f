"""Memory under large rows (issue #17, item 5): one relay process publishes 300 legal
rows of about 900 KB each (incompressible, as Postgres stores them).

Batches used to be capped in rows only: all 300 rows were one batch, held at once as
fetched, decoded, encoded and queued copies (227 MB to 1.02 GB RSS in the issue, against
a 512 MiB pod limit). The figure is the process's peak RSS with the default
``batch_max_bytes``; the baseline, in the same run, is the same relay with no byte cap.
The rows are written once; the two relays take turns publishing them (each through a
new subscriber and topic), ``scale.repetitions`` rounds after an emptied broker, a
CHECKPOINT and a pause (bench/method.py): medians, with their ranges.
"""

from __future__ import annotations

import psycopg

from bench.harness import (
    BATCH,
    Figure,
    RelayProcesses,
    Scale,
    Stack,
    final_positions,
    fresh_subscribers,
    wait_published,
)
from bench.method import interleave, settle
from relay.core.settings import Settings
from relay.core.subscribers import Subscriber, ValueFormat

ROWS = 300
HEX_CHUNKS = 28_125  # md5 hex strings of 32 characters: 900,000 characters per payload
POD_LIMIT_MIB = 512  # deploy/k8s


def run(stack: Stack, scale: Scale) -> list[Figure]:
    default = int(Settings.model_fields["batch_max_bytes"].default)
    url = stack.database("large_rows")
    write_rows(url)

    def settled() -> None:
        stack.fresh_broker()
        settle(url)

    rss = interleave(
        {"uncapped": lambda: peak_rss_mib(stack, url, "large_rows_uncapped", 2**40),
         "capped": lambda: peak_rss_mib(stack, url, "large_rows_capped", default)},
        scale.repetitions, before_each=settled,
    )  # fmt: skip
    return [
        Figure.of("large_rows", f"peak RSS, {ROWS} rows of 900 KB", rss["capped"], "MiB",
                  rss["uncapped"], "no byte cap (batches of batch_size rows)",
                  f"value<={POD_LIMIT_MIB}",
                  {"rows": ROWS, "batch_max_bytes": default, "batch_size": BATCH}),
    ]  # fmt: skip


def write_rows(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               SELECT 'note', 'n-' || r, 'Note', jsonb_build_object('blob', s.blob)
                 FROM generate_series(1, %(rows)s) AS r
                CROSS JOIN LATERAL (
                      SELECT string_agg(md5(random()::text || r || g), '')
                        FROM generate_series(1, %(chunks)s) AS g) AS s(blob)""",
            {"rows": ROWS, "chunks": HEX_CHUNKS},
        )


def peak_rss_mib(stack: Stack, url: str, label: str, batch_max_bytes: int) -> float:
    """One relay process publishing every row of ``url``; its peak RSS."""
    topic = f"{stack.topic_prefix(label)}.notes"
    fresh_subscribers(url, [Subscriber("big", topic=topic, value_format=ValueFormat.JSON)])
    targets = final_positions(url)
    with RelayProcesses(
        stack, url, label, batch_size=BATCH, batch_max_bytes=batch_max_bytes
    ) as relays:
        wait_published(url, targets, timeout=600, tick=relays.check_alive)
        return max(relays.peak_rss_mb())
