"""A part worker's statistics: the counters /metrics exports per part, each declared
once (its metric's name and help beside its field), its state and what it waits on.
The part worker (relay/engine/worker.py) writes them; the daemon reads them (its
/metrics, its health, the halted parts)."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from relay.core.model import Position


class WorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    RETRYING = "retrying"
    HALTED = "halted"
    STOPPED = "stopped"


def _counter(metric: str, help_text: str) -> int:
    """A counter of :class:`WorkerStats`, which /metrics exports per part as ``metric``
    with ``help_text``: each counter is declared here only (#34 item 5)."""
    return field(default=0, metadata={"metric": (metric, help_text)})


@dataclass
class WorkerStats:
    """A part worker's statistics. The worker's thread writes them while scrapes read
    them: every change and read takes ``lock`` (:meth:`counts` reads the counters)."""

    published: int = _counter("outbox_relay_published_events", "Events published to Kafka")
    published_bytes: int = _counter("outbox_relay_published_bytes", "Key and value bytes published")
    batches: int = _counter("outbox_relay_batches", "Batches committed (Kafka, then checkpoint)")
    errors: int = _counter("outbox_relay_errors", "Errors (retried or halting)")
    dead_lettered: int = _counter(
        "outbox_relay_dead_lettered_events", "Poison events dead-lettered"
    )
    # Times a Kafka-side checkpoint was ahead of Postgres (and adopted).
    recovered: int = _counter(
        "outbox_relay_recoveries", "Kafka-side checkpoints adopted on takeover"
    )
    # Kafka-side checkpoints ahead of Postgres that could not be shown to belong to this
    # database (a restore): not adopted, so what they cover may be published again.
    recoveries_refused: int = _counter(
        "outbox_relay_recoveries_refused",
        "Kafka-side checkpoints ahead of Postgres not shown to belong to this database",
    )
    # Events the poison policy handled (dead-lettered or halted on), whatever the cause:
    # unreadable, unencodable, unroutable, or refused by the broker.
    poisoned: int = _counter(
        "outbox_relay_poison_events",
        "Events the part could not publish (dead-lettered, or halting the part)",
    )
    # A flood of poison rows logs the first few a minute one by one, then a summary
    # (relay/core/log_sampling.py): the warnings left out.
    poison_warnings_sampled_out: int = _counter(
        "outbox_relay_poison_warnings_sampled_out",
        "Poison warnings not logged one by one (sampling; a summary line counts them)",
    )
    # Each pays init_transactions and the checkpoint read (hundreds of ms): many per part
    # means more parts are busy at once than max_producers, and they take turns on them.
    producers_opened: int = _counter(
        "outbox_relay_producers_opened",
        "Transactional producers opened for the part (each fences and recovers)",
    )
    # Exceptions outside the relay's error tree (a bug, or a failure nobody foresaw):
    # each is logged with its traceback and the part starts over with backoff.
    unexpected: int = _counter(
        "outbox_relay_unexpected_errors",
        "Errors of no known kind in a part worker (logged with a traceback, then retried)",
    )
    # A worker that stopped on its own on a fatal error: the daemon counts it when it
    # retires the worker (only it knows whether the worker was told to stop).
    failures: int = _counter(
        "outbox_relay_worker_failures",
        "Part workers that stopped on an error retrying cannot fix (the part is then halted)",
    )
    # Exported by the daemon as outbox_relay_key_space_changes{action=...}, not per part.
    key_space_rebased: int = 0  # times this part's connection found and rebased a move
    key_space_continued: int = 0  # ... found a cluster change that kept the key space
    checkpoint: Position | None = None
    last_error: str | None = None
    # What the part's last attempt waits for (RelayError.waits_on: a service it could
    # not reach, "schema_registry", "kafka", "postgres"; or a fix that heals it, "topic",
    # "postgres_privilege", "kafka_acl", "topic_budget"), until a turn goes through.
    waiting_on: str | None = None
    last_published_at: float | None = None
    state: WorkerState = WorkerState.STARTING
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def counts(self) -> Counter[str]:
        """Every count at one instant, the key-space changes included (psycopg_pool's
        get_stats): what the daemon sums per part and /metrics exports."""
        with self.lock:
            return Counter({name: getattr(self, name) for name in _COUNTS})


# Each counter /metrics exports per part: its field's name -> (metric name, help text).
COUNTERS: dict[str, tuple[str, str]] = {
    f.name: f.metadata["metric"] for f in dataclasses.fields(WorkerStats) if f.metadata
}
_COUNTS = (*COUNTERS, "key_space_rebased", "key_space_continued")
