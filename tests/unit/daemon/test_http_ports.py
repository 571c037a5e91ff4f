"""The relay's HTTP ports at start-up, without a database or broker."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from relay.core.settings import Settings
from relay.daemon.metrics import HealthServer
from relay.errors import ConfigError
from relay.localstack.process import free_port


def test_a_probe_port_in_use_is_named_and_the_metrics_port_let_go() -> None:
    """The probe port (metrics_port + 1 by default) taken: the relay says which key and
    port, as for the metrics port. It raised "cannot join thread before it is started"
    while letting go of the metrics port it had opened, a traceback naming neither."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe_port = taken.getsockname()[1]
        metrics_port = free_port()
        settings = Settings(
            metrics_host="127.0.0.1", metrics_port=metrics_port, probe_port=probe_port
        )

        def no_database() -> Any:
            raise AssertionError("not scraped")

        with pytest.raises(
            ConfigError, match=f"probe_port: cannot listen on 127.0.0.1:{probe_port}"
        ):
            HealthServer(object(), no_database, settings)  # type: ignore[arg-type]
    with socket.socket() as again:  # the metrics port it had opened is free again
        again.bind(("127.0.0.1", metrics_port))
