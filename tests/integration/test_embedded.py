"""Self-tests of the real-server fixtures and relay.localstack."""

from __future__ import annotations

import time
import uuid

import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.localstack import LocalPostgres
from tests.support import restart


def test_postgres_answers(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        row = conn.execute("select pg_current_xact_id()::text::bigint").fetchone()
        assert row is not None
        assert row[0] > 0
        assert conn.execute("select current_database()").fetchone() == (
            psycopg.conninfo.conninfo_to_dict(database_url)["dbname"],
        )


def test_broker_idempotent_produce_and_assign_consume(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}roundtrip"
    partitions = 3
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1)]
    )
    futures[topic].result(timeout=30)

    delivered: list[Message] = []
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.append(msg)

    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    sent = {f"key-{i}".encode(): f"value-{i}".encode() for i in range(10)}
    for key, value in sent.items():
        producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert errors == []
    assert len(delivered) == len(sent)

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        received: dict[bytes, bytes] = {}
        deadline = time.monotonic() + 30
        while len(received) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got_key, got_value = msg.key(), msg.value()
            assert isinstance(got_key, bytes)
            assert isinstance(got_value, bytes)
            received[got_key] = got_value
    finally:
        consumer.close()
    assert received == sent


def test_local_postgres_restart_keeps_data(local_postgres: LocalPostgres) -> None:
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        conn.execute("create table kept (id int primary key, note text)")
        conn.execute("insert into kept values (1, 'survives restart')")
    old_pid = local_postgres.pid

    restart(local_postgres)

    assert local_postgres.pid is not None
    assert local_postgres.pid != old_pid
    with psycopg.connect(local_postgres.url) as conn:
        assert conn.execute("select note from kept where id = 1").fetchone() == (
            "survives restart",
        )
