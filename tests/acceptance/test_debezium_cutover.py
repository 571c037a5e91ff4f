"""The documented cut-over from a running Debezium to the relay (deploy/README.md), while
an app keeps writing: every event reaches Kafka exactly once, each key's in order."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from relay.adapters.postgres import migrations
from relay.core.schemas import SchemaFolder
from relay.localstack.debezium import LocalDebeziumServer
from relay.localstack.postgres import LocalPostgres
from tests.acceptance.test_debezium_conformance import (
    SETUPS,
    STANDARD,
    create_topics,
    ours_allowed,
    server_properties,
    start_relay_on,
)
from tests.support import consume, run_cli

pytestmark = pytest.mark.debezium

KEYS = [f"k{i}" for i in range(5)]


class App(threading.Thread):
    """Inserts one event per transaction, round-robin over KEYS, until stopped; each
    payload carries the key's sequence number."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.written: list[tuple[str, int]] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                n = 0
                while not self.stopping.is_set():
                    key = KEYS[n % len(KEYS)]
                    seq = n // len(KEYS)
                    with conn.transaction():  # as apps written for Debezium do
                        conn.execute(
                            "INSERT INTO standard (id, aggregatetype, aggregateid, type, payload)"
                            " VALUES (%s, 'Order', %s, 'Created', %s)",
                            (uuid.uuid4(), key, json.dumps({"seq": seq})),
                        )
                        conn.execute("DELETE FROM standard")
                    self.written.append((key, seq))
                    n += 1
                    time.sleep(0.002)
        except BaseException as exc:
            self.error = exc

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.written) < count:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, "the app stopped writing"
            time.sleep(0.05)


def test_cut_over_from_a_running_debezium_loses_and_duplicates_nothing(
    logical_postgres: LocalPostgres,
    kafka_bootstrap: str,
    tmp_path: Any,
    registry: SchemaFolder,
) -> None:
    with psycopg.connect(logical_postgres.url, autocommit=True) as admin:
        admin.execute("CREATE DATABASE cutover")
    url = logical_postgres.url_for("cutover")
    prefix = f"c{uuid.uuid4().hex[:8]}."
    json_setup = next(s for s in SETUPS if s.name == "json")
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
        conn.execute(f"CREATE TABLE standard ({STANDARD.columns})")
        conn.execute("CREATE TABLE debezium_heartbeat (id int PRIMARY KEY, at timestamptz)")
        conn.execute("INSERT INTO debezium_heartbeat VALUES (1, now())")
    create_topics(kafka_bootstrap, (STANDARD,), (prefix,))
    create_heartbeat_topic(kafka_bootstrap)
    topic = f"{prefix}outbox.event.Order"
    debezium = LocalDebeziumServer(
        tmp_path / "debezium",
        {
            **server_properties(logical_postgres, "cutover", kafka_bootstrap, prefix, (STANDARD,)),
            **json_setup.server,
            # Debezium confirms its position to the slot only as it processes changes of
            # the tables it captures: its heartbeat query makes one (Debezium's own advice
            # for databases whose captured tables go quiet).
            "debezium.source.heartbeat.interval.ms": "200",
            "debezium.source.heartbeat.action.query": (
                "UPDATE debezium_heartbeat SET at = now() WHERE id = 1"
            ),
            "debezium.source.table.include.list": "public.standard,public.debezium_heartbeat",
        },
    )
    debezium.start()
    app = App(url)
    try:
        debezium.wait_streaming(url)
        app.start()
        app.wait_for(100)  # Debezium is publishing

        # 1. The switch, while the app writes: one transaction.
        switched = run_cli(
            "debezium", "attach", "standard", "--cut-over", "dbz_cutover",
            *[a for o in (*STANDARD.options, *json_setup.relay,
                          f"route.topic.replacement={prefix}outbox.event.${{routedByValue}}")
              for a in ("-o", o)],
            env={"RELAY_DATABASE_URL": url},
        )  # fmt: skip
        assert switched.returncode == 0, switched.stderr
        lsn = switched.stdout.split("cut-over-lsn=")[1].split()[0]
        app.wait_for(len(app.written) + 100)  # the relay's outbox fills meanwhile

        # 2. Debezium has published all it owns once its slot confirms the switch.
        wait_confirmed(url, "dbz_cutover", lsn)
        debezium.stop()

        # 3. The relay takes over.
        # Debezium made the topics, not the relay: the operator names them (issue #47).
        relay = start_relay_on(url, kafka_bootstrap, registry, topic_allow=ours_allowed(prefix))
        try:
            app.wait_for(len(app.written) + 100)
            app.stopping.set()
            app.join()
            seen = consume(kafka_bootstrap, [topic], len(app.written), timeout=60)
            with psycopg.connect(url) as conn:
                copied = conn.execute("SELECT count(*) FROM outbox").fetchone()
        finally:
            relay.stop()
    finally:
        app.stopping.set()
        debezium.stop()
    assert app.error is None
    # Both published a share: Debezium the events before the switch, the relay the rest.
    assert copied is not None and 100 <= copied[0] <= len(app.written) - 100
    published = [(json.loads(r.key or b""), json.loads(r.value or b"")) for r in seen]
    events = [(key, json.loads(value)["seq"]) for key, value in published]
    assert sorted(events) == sorted(app.written)  # each exactly once
    for key in KEYS:
        in_kafka = [seq for k, seq in events if k == key]  # one key: one partition
        assert in_kafka == sorted(in_kafka), f"{key} out of order"


def create_heartbeat_topic(bootstrap: str) -> None:
    """Debezium's heartbeats go to __debezium-heartbeat.<topic.prefix>, its heartbeat
    table's changes to their own topic; the broker creates no topic by itself."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = ["__debezium-heartbeat.dbz", "dbz.public.debezium_heartbeat"]
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def wait_confirmed(url: str, slot: str, lsn: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots"
                " WHERE slot_name = %s",
                (lsn, slot),
            ).fetchone()
            if row and row[0]:
                return
            assert time.monotonic() < deadline, f"slot {slot} never confirmed {lsn}"
            time.sleep(0.2)
