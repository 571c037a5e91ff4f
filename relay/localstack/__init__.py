"""The local stack: real PostgreSQL and Apache Kafka processes on 127.0.0.1, no Docker.

Used by ``outbox-relay dev`` (``./dev.sh demo``, :mod:`relay.localstack.demo`),
``outbox-relay local`` (the stack without the demo, :mod:`relay.localstack.stack`), the
test fixtures and the benchmarks. Nothing in the relay daemon depends on it; the CLI
imports it only for those two commands.
"""

from relay.localstack.kafka import KAFKA_VERSION, LocalKafka, LocalKafkaCluster
from relay.localstack.postgres import LocalPostgres
from relay.localstack.process import LocalServerError, free_port

__all__ = [
    "KAFKA_VERSION",
    "LocalKafka",
    "LocalKafkaCluster",
    "LocalPostgres",
    "LocalServerError",
    "free_port",
]
