"""The relay's admin client: one, opened on first use, that its broker watch, topic
creation and replication check share.

Each librdkafka client runs 4-5 threads for as long as it lives. A relay kept one for
its broker watch and one for creating topics: two clients doing a request now and then
(#53: 1,000 subscribers on one relay within 128 threads). A client serves requests from
many threads at once, each with its own timeout, so one waiting does not hold another.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from confluent_kafka.admin import AdminClient

from relay.adapters.kafka.client_logs import client_logger

# What an admin client needs from the relay's Kafka settings: where the brokers are
# and how to connect. Producer settings stay out (a bad one is the producer's to report).
_CONNECTION_KEYS = (
    "bootstrap.", "security.", "sasl.", "ssl.", "socket.", "broker.", "client.",
    "reconnect.", "api.version", "enable.ssl", "enable.sasl", "metadata.", "topic.metadata",
)  # fmt: skip


def connection_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """An admin client's configuration from the relay's Kafka settings."""
    client: dict[str, Any] = {k: v for k, v in config.items() if k.startswith(_CONNECTION_KEYS)}
    client["logger"] = client_logger()
    return client


class SharedAdmin:
    """One admin client for ``config`` (the relay's Kafka settings), opened by the first
    call and handed to every caller after it."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = connection_config(config)
        self._lock = threading.Lock()
        self._client: AdminClient | None = None

    def __call__(self) -> AdminClient:
        with self._lock:
            if self._client is None:
                self._client = AdminClient(self._config)
            return self._client
