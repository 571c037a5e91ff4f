"""The local stack's Apache Kafka on a real JVM: a port in use is named, a log that
survives ``kill -9``, and read_committed that hides aborted records."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.localstack import LocalKafka, LocalServerError
from tests.support import consume


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LocalServerError, match=f"port {port} on 127.0.0.1 is in use"):
            LocalKafka(tmp_path / "k", port=port).start()


def test_kill_9_and_restart_loses_no_committed_record_and_hides_aborted_ones(
    local_kafka: LocalKafka, topic_prefix: str
) -> None:
    bootstrap = local_kafka.bootstrap_servers
    topic = topic_prefix + "restart"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": uuid.uuid4().hex})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, key=b"k", value=f"aborted-{i}".encode())
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(topic, key=b"k", value=f"committed-{i}".encode())
    producer.commit_transaction(30)
    old_pid = local_kafka.pid
    assert old_pid is not None

    os.kill(old_pid, signal.SIGKILL)
    while local_kafka.running:  # until the kernel has delivered it
        time.sleep(0.01)
    local_kafka.start()

    assert local_kafka.pid not in (None, old_pid)
    seen = consume(bootstrap, [topic], expected=5, timeout=60)
    assert [s.value for s in seen] == [f"committed-{i}".encode() for i in range(5)]
    everything = consume(bootstrap, [topic], expected=15, isolation="read_uncommitted")
    assert len(everything) == 15  # the aborted records are on the log, hidden above
