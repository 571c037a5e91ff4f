"""Issue #27: whatever rows a writer inserts, the relay's memory stays bounded. Rows are
counted as they are (decompressed, every column the relay reads), and a row too large
for any Kafka record is poison decided in SQL, without fetching its content. The relay
runs as users run it, in its own process, so its peak resident memory (VmHWM) is its
own: a resource bound, not a timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from tests.support import REPO, caught_up, consume, keys, wait_until, write_orders

_PEAK_RSS_LIMIT_MB = 300
_HUGE_ROWS = 20  # payloads of 10 MB, highly compressible (stored at about 1/90th)
_LONG_TYPE_ROWS = 100  # event types of 1 MB


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _write_hostile_rows(db: psycopg.Connection[Any], outbox: Outbox) -> int:
    """Ordinary rows around hostile ones; returns how many rows of 1 MB event type the
    schema took (a schema with length limits on event_type refuses them)."""
    write_orders(db, outbox, ["before"])
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'order', 'huge-' || n, 'Note', jsonb_build_object('blob', repeat('x', 10000000))"
        "   FROM generate_series(1, %s) AS n",
        (_HUGE_ROWS,),
    )
    write_orders(db, outbox, ["between"])
    try:
        db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', 'long-' || n, repeat('E', 1000000), '{}'"
            "   FROM generate_series(1, %s) AS n",
            (_LONG_TYPE_ROWS,),
        )
        long_rows = _LONG_TYPE_ROWS
    except errors.CheckViolation:
        long_rows = 0
    write_orders(db, outbox, ["after"])
    return long_rows


def test_peak_memory_stays_bounded_whatever_rows_a_writer_inserts(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    store = OutboxStore(db)
    dead = topic_prefix + "dead"
    store.add(
        Subscriber(
            "dl",
            topic=topic_prefix + "outbox.event.{aggregate_type}",
            value_format=ValueFormat.JSON,
            on_poison=PoisonPolicy.DEAD_LETTER,
            dead_letter_topic=dead,
        )
    )
    store.add(
        Subscriber("halt", topic=topic_prefix + "h.{aggregate_type}", value_format=ValueFormat.JSON)
    )
    long_rows = _write_hostile_rows(writer_db, outbox)
    env = {
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_METRICS_PORT": "0",
        "RELAY_POLL_INTERVAL": "0.2",
    }
    log = tmp_path / "relay.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "run"],
            env={**os.environ, **env},
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            wait_until(
                lambda: (
                    proc.poll() is not None
                    or (caught_up(db, "dl") and store.get_part("halt", 0).halted_error is not None)
                ),
                timeout=180,
                what="the relay to publish every row and halt the halting subscriber",
            )
            finished = True
        except AssertionError:
            finished = False
        assert proc.poll() is None, log.read_text()[-3000:]
        peak = _peak_rss_mb(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    assert peak < _PEAK_RSS_LIMIT_MB, f"peak RSS {peak:.0f} MB; log: {log.read_text()[-2000:]}"
    assert finished, f"dl: {store.get('dl').parts}; log: {log.read_text()[-3000:]}"
    # Every publishable row is published; every hostile one is dead-lettered, small.
    published = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 3)
    assert keys(published) == ["after", "before", "between"]
    letters = consume(kafka_bootstrap, [dead], _HUGE_ROWS + long_rows, timeout=60)
    assert len(letters) == _HUGE_ROWS + long_rows
    assert len({r.message_id for r in letters}) == len(letters)
    for letter in letters:
        document = json.loads(letter.value or b"")
        assert document["message_id"] and document["transaction_id"] and document["error"]
        assert len(letter.value or b"") < 100_000
    huge = [r for r in letters if (r.key or b"").startswith(b"huge-")]
    assert len(huge) == _HUGE_ROWS
    assert all("bytes" in (r.header_text("outbox.error") or "") for r in huge)
    # The halting subscriber stops at the first huge row, saying why.
    halted = store.get_part("halt", 0).halted_error
    assert halted is not None and "bytes" in halted
