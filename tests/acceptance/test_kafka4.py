"""Kafka 4 specifics, on a broker of their own with tight transaction limits: a
transaction timeout the broker refuses, and transactional ids that expire while a relay
idles. (The checkpoint's group coordinator and fencing are exercised everywhere else.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from relay.errors import ConfigError
from relay.localstack import LocalKafka
from tests.support import consume, ids_of, unstarted_publishers, write_orders


@pytest.fixture(scope="module")
def strict_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    broker = LocalKafka(
        tmp_path_factory.mktemp("strict-kafka"),
        config={
            "transaction.max.timeout.ms": "100000",
            # Expire idle transactional ids within seconds, and look for them every second.
            "transactional.id.expiration.ms": "2000",
            "transaction.remove.expired.transaction.cleanup.interval.ms": "1000",
        },
    )
    with broker:
        yield broker


def test_a_transaction_timeout_above_the_brokers_cap_is_a_config_error_naming_the_fix(
    db: psycopg.Connection[Any], relay_url: str, strict_kafka: LocalKafka
) -> None:
    store = OutboxStore(db)
    store.add(Subscriber("s"))
    # A session of 120 s: 120 s of transaction.timeout.ms, above the broker's 100 s.
    settings = load_settings(
        database_url=relay_url,
        bootstrap_servers=strict_kafka.bootstrap_servers,
        session_timeout=120,
    )
    publisher = unstarted_publishers(Relay(settings), db)(store.get_part("s", 0))
    try:
        with pytest.raises(ConfigError) as refused:
            publisher.recover("g")
    finally:
        publisher.close()
    message = str(refused.value)
    assert "transaction.timeout.ms=120000" in message
    assert "session_timeout" in message and "transaction.max.timeout.ms" in message


def test_an_expired_transactional_id_costs_a_retry_not_an_event(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    outbox: Outbox,
    strict_kafka: LocalKafka,
    topic_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.kafka.kafka")
    store = OutboxStore(db)
    store.add(
        Subscriber("s", topic=topic_prefix + "{aggregate_type}", value_format=ValueFormat.JSON)
    )
    settings = load_settings(
        database_url=relay_url,
        bootstrap_servers=strict_kafka.bootstrap_servers,
        poll_interval=0.2,
        metrics_port=0,
    )
    relay = Relay(settings)
    relay.start()
    try:
        write_orders(writer_db, outbox, ["before"])
        consume(strict_kafka.bootstrap_servers, [topic_prefix + "order"], 1)
        time.sleep(6)  # idle: the broker expires the part's transactional id meanwhile
        write_orders(writer_db, outbox, ["after-1", "after-2"])
        seen = consume(strict_kafka.bootstrap_servers, [topic_prefix + "order"], 3)
        assert all(state == WorkerState.RUNNING for state in relay.part_states().values())
    finally:
        relay.stop()
    written = [str(r[0]) for r in db.execute("SELECT message_id FROM outbox ORDER BY position")]
    assert sorted(ids_of(seen)) == sorted(written)  # each once (3 keys, 3 partitions)
    # The id did expire, and the relay retried: the broker refused the first transaction
    # after the idle spell for a producer id no longer mapped to its transactional id
    # (INVALID_PRODUCER_ID_MAPPING), and the relay ran that batch again.
    retries = [
        r.getMessage()
        for r in caplog.records
        if r.name == "relay.adapters.kafka.kafka"
        and r.getMessage().startswith("transaction aborted")
    ]
    assert retries, "no transaction was aborted: the transactional id never expired"
    assert any("not currently assigned to its transactional id" in m for m in retries), retries
