"""Issue #28: a broker's normal warm-up (coordinators still loading) is not a warning; nor
is a client ignoring a setting meant for the other kind of client."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import Consumer, Producer

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


def test_a_setting_for_the_other_kind_of_client_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay hands its one ``kafka`` table to producers and to checkpoint consumers
    alike; librdkafka's note that one of them ignores a setting is by design."""
    log = client_logger()
    nowhere = "127.0.0.1:1"  # the note comes at construction, before any connection
    with caplog.at_level(logging.DEBUG, logger=log.name):
        consumer = Consumer(
            {"bootstrap.servers": nowhere, "group.id": "unit", "linger.ms": 7, "logger": log}
        )
        producer = Producer(
            {"bootstrap.servers": nowhere, "session.timeout.ms": 12_345, "logger": log}
        )
        try:
            consumer.poll(0.2)  # serves the client's log queue
            producer.poll(0.2)
        finally:
            consumer.close()
            producer.close()
    notes = [r for r in caplog.records if "will be ignored by this" in r.getMessage()]
    # One note each: linger.ms for the consumer, session.timeout.ms for the producer.
    assert [r.levelno for r in notes] == [logging.DEBUG] * 2, [
        (r.levelname, r.getMessage()) for r in notes
    ]
