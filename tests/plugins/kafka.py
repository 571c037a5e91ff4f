"""The session's Apache Kafka broker (``kafka``, ``kafka_bootstrap``), a broker chaos
tests may kill (``local_kafka``), a three-node cluster whose nodes they may kill
(``kafka_cluster``), and per-test topic names.

Resolution order of ``kafka``: an external broker named by
``OUTBOX_TEST_BOOTSTRAP_SERVERS``; an ``apache/kafka`` testcontainers container when a
Docker engine answers; a local process from :mod:`relay.localstack` (Apache Kafka's
pinned jars from Maven Central on a local JVM). One broker serves the whole session;
every test names its own topics (``topic_prefix``). ``local_kafka`` is that broker when
it is a local process, else a local process of its own: the kill tests run in every
setup. ``kafka_cluster`` is always local processes.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from relay.localstack import KAFKA_VERSION, LocalKafka, LocalKafkaCluster, free_port
from relay.localstack.kafka import wait_until_answers
from tests.plugins.containers import docker_available

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TestKafka:
    """The session's broker: its address, and the process when we started it here."""

    bootstrap_servers: str
    local: LocalKafka | None = None


def _apache_kafka_container() -> Any:
    """An ``apache/kafka`` container (KRaft, single node), advertised on a fixed host port."""
    from testcontainers.core.container import DockerContainer

    port = free_port()
    container = DockerContainer(f"apache/kafka:{KAFKA_VERSION}").with_bind_ports(9092, port)
    # The image takes either no KAFKA_* variables or a whole configuration: the latter,
    # as deploy/docker-compose.yml does.
    env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
    }
    for key, value in env.items():
        container = container.with_env(key, value)
    return container, port


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestKafka]:
    """The Apache Kafka broker shared by the session."""
    external = os.environ.get("OUTBOX_TEST_BOOTSTRAP_SERVERS")
    if external:
        yield TestKafka(external)
        return

    if docker_available():
        container, port = _apache_kafka_container()
        with container:
            bootstrap = f"127.0.0.1:{port}"
            wait_until_answers(bootstrap, timeout=90)
            yield TestKafka(bootstrap)
        return

    broker = LocalKafka(tmp_path_factory.mktemp("kafka"))
    with broker:
        _log.info("Apache Kafka for the tests started in %.1fs", broker.startup_seconds)
        yield TestKafka(broker.bootstrap_servers, broker)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka: TestKafka) -> str:
    """``bootstrap.servers`` of the session's broker."""
    return kafka.bootstrap_servers


@pytest.fixture(scope="session")
def _killable_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A local broker for the kill tests when the session's is external or a container."""
    broker = LocalKafka(tmp_path_factory.mktemp("killable-kafka"))
    with broker:
        yield broker


@pytest.fixture
def local_kafka(kafka: TestKafka, request: pytest.FixtureRequest) -> LocalKafka:
    """A broker process we may kill and restart (chaos tests): the session's broker when
    it is a local process, else one started for these tests (never skipped).

    A test that stops it must start it again before it ends: the session shares it.
    """
    if kafka.local is not None:
        return kafka.local
    broker: LocalKafka = request.getfixturevalue("_killable_kafka")
    return broker


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafkaCluster]:
    """Three local Kafka nodes (broker and controller each) in one KRaft cluster:
    replication factor 3, min.insync.replicas 2, the transaction state log likewise.

    Tests may kill and restart nodes (``nodes[i].kill()``, ``.start()``); each test must
    leave every node running: the session shares the cluster.
    """
    cluster = LocalKafkaCluster(tmp_path_factory.mktemp("kafka-cluster"), nodes=3)
    with cluster:
        yield cluster


@pytest.fixture
def topic_prefix() -> str:
    """A unique topic-name prefix such as ``t1a2b3c4d.``; the broker is shared."""
    return f"t{uuid.uuid4().hex[:8]}."
