"""What a relay's stop lets go, on a relay never started (nothing to reach)."""

from __future__ import annotations

import threading

from pydantic import SecretStr

from relay.core.settings import Settings
from relay.daemon import Relay


def test_a_stopped_relay_s_kafka_helper_threads_end() -> None:
    # The threads its parts' producers share to commit and recover (PublisherFactory)
    # waited idle past the stop, for the life of whatever process embeds the relay.
    settings = Settings(
        database_url=SecretStr("postgresql://u@127.0.0.1:1/d"),
        bootstrap_servers="127.0.0.1:1",
        metrics_enabled=False,
    )
    relay = Relay(settings)
    helper = relay.publishers._helpers.submit(threading.current_thread).result(5)
    relay.stop(timeout=1)
    helper.join(5)
    assert not helper.is_alive()
