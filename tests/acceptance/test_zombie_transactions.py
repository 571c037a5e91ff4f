"""A relay cut off from Kafka cannot end the transaction it has open, and until it ends,
the last stable offset of every partition it wrote stays where that transaction began:
``read_committed`` readers see nothing past it there, a healthy peer's records included
(issue #49: 31 s of nothing on a peer's part). The relay's transactions now time out on
the broker with the session (relay/adapters/kafka/kafka.py, ``transaction_timeout``), and
a relay that takes the part over aborts it at once (its ``init_transactions``).

The zombie is played by a relay's own publisher, as the relay builds it, stopped between
producing its records and committing them: nothing ever ends its transaction. Its ids
are a part no relay serves (a subscriber removed meanwhile), so no takeover aborts it
in the first test; in the second, it is a part the live relay takes over.

The waits are bounds that tell the behaviours apart, not measurements: the old
transaction timeout was 90 s (3 x delivery_timeout), the new one is 10 s (the session's
6 s, at least 10 s), plus the broker's check of timed-out transactions every 10 s."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import closing, contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any

import psycopg

from relay import Outbox
from relay.adapters.kafka.publishers import PublisherFactory
from relay.adapters.kafka.topic_reader import KafkaTopicReader
from relay.adapters.postgres.store import OutboxStore
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.core.model import ConsumedRecord, KafkaRecord, Position
from relay.core.ports import Batch
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber, ValueFormat
from relay.daemon import Relay
from tests.support import caught_up, wait_until, write_orders

SESSION_TIMEOUT = 6.0
# Below the old transaction timeout (90 s), well above the new one and the broker's
# 10 s check after it: a bound that tells the two apart on a loaded machine.
VISIBLE_WITHIN = 50.0
Records = Generator[ConsumedRecord | None, None, None]


def _factory(relay: Relay, conn: psycopg.Connection[Any]) -> PublisherFactory:
    """The publishers of ``relay`` (not the one running), built as the relay builds its
    own; their record of topics borrows the test's connection as the relay role."""
    return PublisherFactory(
        relay.settings, relay.topic_guard, PostgresTopicRecord(lambda: nullcontext(conn))
    )


@contextmanager
def _open_transaction(publisher: Any, record: KafkaRecord) -> Iterator[None]:
    """``publisher`` produces ``record`` in a transaction, then stops before committing
    it (its read-ahead never returns) until the block ends."""
    release = threading.Event()

    def stuck() -> None:
        release.wait()

    def publish() -> None:
        try:
            publisher.recover("zombie")
            publisher.publish(Batch([record], Position(1, 1), "zombie"), meanwhile=stuck)
        except Exception:  # fenced or aborted meanwhile: what the test is about
            pass

    thread = threading.Thread(target=publish, name="zombie-publisher", daemon=True)
    thread.start()
    try:
        yield
    finally:
        release.set()
        thread.join(60)
        publisher.close()


def _reader(bootstrap: str, topic: str, isolation: str) -> Records:
    reader = KafkaTopicReader(
        {"bootstrap.servers": bootstrap}, group="zombie-test", isolation=isolation
    )
    return reader.follow([topic])


def _seen(records: Records, into: list[ConsumedRecord]) -> Callable[[], list[bytes]]:
    """Reads what ``records`` has now into ``into``; the values seen so far."""

    def read() -> list[bytes]:
        while (record := next(records)) is not None:
            into.append(record)
        return [r.value or b"" for r in into]

    return read


@contextmanager
def _zombie(publisher: Any, bootstrap: str, topic: str) -> Iterator[Callable[[], list[bytes]]]:
    """``publisher``'s transaction open, its record on ``topic`` appended; yields what a
    ``read_committed`` reader of ``topic`` has seen so far."""
    uncommitted: list[ConsumedRecord] = []
    committed: list[ConsumedRecord] = []
    with (
        closing(_reader(bootstrap, topic, "read_uncommitted")) as raw,
        closing(_reader(bootstrap, topic, "read_committed")) as readers,
        _open_transaction(publisher, KafkaRecord(topic, b"k", b"zombie", [])),
    ):
        appended = _seen(raw, uncommitted)
        wait_until(lambda: b"zombie" in appended(), what="the zombie's record appended")
        yield _seen(readers, committed)


def _subscriber(relay_db: psycopg.Connection[Any], topic_prefix: str) -> None:
    OutboxStore(relay_db).add(
        Subscriber(
            "s", topic=topic_prefix + "outbox.event.{aggregate_type}", value_format=ValueFormat.JSON
        )
    )


def test_a_zombies_open_transaction_times_out_with_the_session(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    topic = topic_prefix + "outbox.event.order"
    _subscriber(relay_db, topic_prefix)
    relay = start_relay(session_timeout=SESSION_TIMEOUT, heartbeat_interval=1.0, topic_partitions=1)
    write_orders(writer_db, outbox, ["before"])
    wait_until(lambda: caught_up(db, "s"), what="the relay to publish")
    # A part no relay serves: nobody takes it over, only the timeout ends its transaction.
    zombie = _factory(relay, relay_db)(SimpleNamespace(name="removed", part=0, subscriber_id=0))  # type: ignore[arg-type]
    with _zombie(zombie, kafka_bootstrap, topic) as visible:
        write_orders(writer_db, outbox, ["after-1", "after-2"])
        wait_until(lambda: caught_up(db, "s"), what="the healthy relay to commit")
        wait_until(
            lambda: sum(b"after-" in v for v in visible()) == 2,
            timeout=VISIBLE_WITHIN,
            what="the healthy relay's records past the zombie's open transaction",
        )
        assert b"zombie" not in visible()  # aborted, never committed


def test_a_relay_taking_the_part_over_aborts_the_zombies_transaction_at_once(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_db: psycopg.Connection[Any],
    relay_url: str,
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    # The zombie's transaction would outlive the wait (60 s, then the broker's check):
    # only the taking relay's init_transactions on the part's ids can end it in time. Its
    # part ("s") has no row to publish, so only a recovery run as the part is claimed
    # does; a peer part ("p") writes to the same partition.
    topic = topic_prefix + "outbox.event.order"
    store = OutboxStore(relay_db)
    store.add(
        Subscriber(
            "s",
            topic=topic,
            value_format=ValueFormat.JSON,
            event_types=frozenset({"NeverWritten"}),
        )
    )
    store.add(
        Subscriber(
            "p",
            topic=topic,
            value_format=ValueFormat.JSON,
            event_types=frozenset({"OrderPlaced"}),
        )
    )
    write_orders(writer_db, outbox, ["taken-1"])
    settings = load_settings(
        database_url=relay_url,
        bootstrap_servers=kafka_bootstrap,
        session_timeout=60.0,
        topic_partitions=1,
        metrics_port=0,
    )
    zombie = _factory(Relay(settings), relay_db)(OutboxStore(relay_db).get_part("s", 0))
    with _zombie(zombie, kafka_bootstrap, topic) as visible:
        start_relay(session_timeout=SESSION_TIMEOUT, heartbeat_interval=1.0, topic_partitions=1)
        write_orders(writer_db, outbox, ["taken-2"])
        wait_until(
            lambda: sum(b"taken-" in v for v in visible()) == 2,
            timeout=40.0,
            what="the taking relay's records past the zombie's aborted transaction",
        )
        assert b"zombie" not in visible()
