"""The relay's one admin client (relay/adapters/kafka/admin.py), never reaching a broker:
librdkafka connects only when a request is made."""

from __future__ import annotations

from pydantic import SecretStr

from relay.adapters.kafka.admin import SharedAdmin, connection_config
from relay.adapters.kafka.broker_watch import BrokerWatch
from relay.core.settings import Settings
from relay.daemon import Relay


def test_one_client_is_opened_on_first_use_and_handed_to_every_caller() -> None:
    shared = SharedAdmin({"bootstrap.servers": "127.0.0.1:1"})
    assert shared._client is None  # nothing opened until a caller needs it
    assert shared() is shared()


def test_only_connection_settings_reach_the_admin_client() -> None:
    # A producer setting the admin client does not know is the producer's to report;
    # the watch must not fail on it.
    config = connection_config(
        {"bootstrap.servers": "b:1", "sasl.username": "u", "linger.ms": "5", "acks": "all"}
    )
    assert {k for k in config if k != "logger"} == {"bootstrap.servers", "sasl.username"}


def test_a_relay_s_broker_watch_and_topic_creation_share_one_admin_client() -> None:
    """Each client runs 4-5 threads for its life: a relay kept two (#53)."""
    settings = Settings(
        database_url=SecretStr("postgresql://u@127.0.0.1:1/d"),
        bootstrap_servers="127.0.0.1:1",
        metrics_enabled=False,
    )
    relay = Relay(settings)
    try:
        # As the relay's membership opens its watch once Kafka is to be asked:
        watch = BrokerWatch({}, interval=1.0, timeout=0.1, admin=relay.membership._admin)
        assert relay.publishers._topics._admin() is watch._admin
    finally:
        relay.stop(timeout=1)
