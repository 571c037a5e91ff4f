"""Issue #28: a broker's normal warm-up (coordinators still loading) is not a warning."""

from __future__ import annotations

import logging

import pytest

from relay.adapters.kafka.client_logs import client_logger

WARM_UP = (
    "GETPID [rdkafka#producer-3] [thrd:main]: Failed to acquire transactional PID from "
    "broker TxnCoordinator/1: Broker: {}: retrying"
)


@pytest.mark.parametrize("reason", ["Coordinator load in progress", "Not coordinator"])
def test_coordinator_warm_up_is_logged_at_info(
    caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    log = client_logger()
    with caplog.at_level(logging.INFO, logger=log.name):
        # A kind of line no client logged before in this process: the filter that holds
        # repeats back for a minute is the process's, and a relay test's broker logs the
        # very same warm-up line.
        log.warning("%s (unit test)", WARM_UP.format(reason))
    assert [(r.levelno, reason in r.getMessage()) for r in caplog.records] == [(logging.INFO, True)]


def test_warm_up_lines_are_dropped_where_info_is_off(caplog: pytest.LogCaptureFixture) -> None:
    log = client_logger()
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning(WARM_UP.format("Coordinator load in progress (2)"))
        log.warning("Receive failed: Connection refused (other)")
    assert [r.getMessage() for r in caplog.records] == [
        "Receive failed: Connection refused (other)"
    ]
