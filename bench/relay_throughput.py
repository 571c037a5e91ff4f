"""Relay throughput on the embedded stack, as a ratio against a same-run baseline.

    .venv/bin/python bench/relay_throughput.py [--events 100000]

Baseline: the same rows read with a plain keyset query and produced with a plain
idempotent confluent-kafka producer (no relay logic). Relay: an in-process relay
publishing the backlog (Avro values, default subscriber) until its checkpoint reaches
the last row. Prints a table and writes bench/results/relay_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psycopg
from confluent_kafka import Producer

from relay import migrations
from relay.daemon import Relay
from relay.embedded import LocalBroker, LocalPostgres
from relay.settings import load_settings
from relay.store import OutboxStore

REPO = Path(__file__).resolve().parent.parent
NOTE = "x" * 230  # makes the Avro value about 300 bytes


def fill(url: str, events: int) -> None:
    payload = json.dumps(
        {"order_id": "o", "customer_id": "c", "amount_cents": 1, "currency": "EUR", "note": NOTE}
    )
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        with cur.copy(
            "COPY outbox (aggregate_type, aggregate_id, event_type, payload) FROM STDIN"
        ) as copy:
            for i in range(events):
                copy.write_row(("order", str(i % 1000), "OrderPlaced", payload))
        conn.commit()


def baseline(url: str, bootstrap: str, events: int) -> float:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5}
    )
    start = time.perf_counter()
    after = (0, 0)
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT transaction_id::text::bigint, position, aggregate_id, payload::text FROM outbox"
                " WHERE (transaction_id, position) > (%s::text::xid8, %s)"
                " AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())"
                " ORDER BY transaction_id, position LIMIT 1000",
                after,
            ).fetchall()
            if not rows:
                break
            for row in rows:
                while True:
                    try:
                        producer.produce("bench.baseline", row[3].encode(), row[2].encode())
                        break
                    except BufferError:
                        producer.poll(0.01)
            producer.flush()
            after = (rows[-1][0], rows[-1][1])
    return events / (time.perf_counter() - start)


def relay_rate(url: str, bootstrap: str, events: int) -> float:
    settings = load_settings(
        database_url=url,
        bootstrap_servers=bootstrap,
        schemas_dir=REPO / "schemas",
        metrics_enabled=False,
    )
    relay = Relay(settings)
    start = time.perf_counter()
    relay.start()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            store = OutboxStore(conn)
            while store.get("default").lag(store) > 0:
                time.sleep(0.05)
    finally:
        elapsed = time.perf_counter() - start
        relay.stop()
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    workdir.chmod(0o755)
    with LocalPostgres(workdir / "pg", fsync=False) as pg, LocalBroker() as broker:
        url = pg.url
        with psycopg.connect(url, autocommit=True) as conn:
            migrations.migrate(conn)
        fill(url, args.events)
        base = baseline(url, broker.bootstrap_servers, args.events)
        rate = relay_rate(url, broker.bootstrap_servers, args.events)
    result = {
        "events": args.events,
        "baseline_events_per_s": round(base),
        "relay_events_per_s": round(rate),
        "ratio": round(rate / base, 3),
    }
    print(f"{'events':>10} {'baseline ev/s':>14} {'relay ev/s':>11} {'ratio':>6}")
    print(f"{args.events:>10} {base:>14,.0f} {rate:>11,.0f} {rate / base:>6.2f}")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "relay_throughput.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
