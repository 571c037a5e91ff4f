"""The Kafka side: publishing one batch of records, transactionally or idempotently.

Two modes:

* :class:`TransactionalPublisher` (the default): each batch is one Kafka transaction
  under a ``transactional.id`` stable per subscriber part. The transaction also
  commits the part's checkpoint as consumer-group offsets, so after a crash between
  the Kafka commit and the Postgres checkpoint update, :meth:`recover` tells the next
  owner exactly where publication stopped. Exactly once, with read_committed consumers.
* :class:`IdempotentPublisher`: for brokers without transactions. Ordered per key and
  without duplicates while the producer lives; at-least-once across restarts.
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.adapters.kafka.call_thread import CallThread, Step, Steps
from relay.adapters.kafka.checkpoint_groups import CHECKPOINT_PARTITIONS, CheckpointGroups
from relay.adapters.kafka.client_logs import client_logger
from relay.adapters.kafka.kafka_errors import (
    Stage,
    classify,
    coordinator_moved,
    rejects_record,
    retry_now,
)
from relay.core import dead_letter_tag
from relay.core.log_fields import log_extra
from relay.core.log_sampling import SampledLog
from relay.core.model import KafkaCheckpoint, KafkaRecord, Position
from relay.core.ports import Batch, Meanwhile, Owned, TopicOrigin, TopicRecord
from relay.errors import (
    AclRefused,
    BrokerUnavailable,
    PoisonRecordError,
    ProducerFenced,
    RelayError,
    TopicBudgetFull,
    TopicMissing,
    TopicRefused,
    TransactionAborted,
)

logger = logging.getLogger(__name__)
_PARTITION = operator.attrgetter("partition")
# librdkafka's own lines: deduplicated, at most one of a kind a minute.
_client_log = client_logger()

# How long one transactional call (init, send offsets, commit, abort) may wait. A call
# that times out with a retriable error is made again (librdkafka resumes it), up to the
# delivery timeout, so this bounds one attempt, not the whole: and so it bounds the
# watchdog too (see _watched). A call librdkafka leaves hanging after its transaction
# coordinator moved then costs the part this plus the grace period, then a new producer
# (issue #29: with 5 s + 5 s, a node kill stalled parts up to 19-30 s).
_TXN_CALL_TIMEOUT_S = 3.0
# How long past its own timeout a transactional call may block before it is given up.
# Calls that return, return within about a second of their timeout even on a loaded
# host (measured: at most 2.5 s on a 2-core machine at load 35).
_CALL_GRACE_S = 3.0
# A transactional call slower than this is logged (with what it took): at DEBUG, and at
# INFO only the first of each minute in the process, then a count of the others. A
# loaded relay's calls pass a second every few seconds; INFO says what changed.
_SLOW_CALL_S = 1.0
_SLOW_CALLS = SampledLog(
    logger,
    "%d more Kafka transaction calls took over 1s in %.0fs (each is logged at DEBUG)",
    lambda count: log_extra("kafka_txn_calls_slow", calls=count),
    first=1,
    level=logging.INFO,
)
_SLOW_CALLS_LOCK = threading.Lock()
# Producers whose call hung: kept referenced, because destroying one would block too.
_abandoned: list[Producer] = []
# The Kafka-side checkpoint: partition 0's committed offset is the transaction id,
# partition 1's the position (offsets are the only group state every broker keeps; see
# checkpoint_groups.py).
# The checkpoint's tag is offset-commit metadata: brokers refuse more than
# offset.metadata.max.bytes (4096 by default).
_MAX_TAG_BYTES = 4000


# The brokers' default transaction.max.timeout.ms (15 min): a longer timeout is refused.
_MAX_TRANSACTION_TIMEOUT_S = 900.0
# A healthy batch's transaction (its records, then the commit's round trips) must fit in
# the timeout, on a loaded host too: a shorter session_timeout does not shorten it.
_MIN_TRANSACTION_TIMEOUT_S = 10.0


def transaction_timeout(session_timeout_s: float) -> float:
    """``transaction.timeout.ms`` (in seconds) of a relay's transactional producers: the
    session timeout, within 10 s and 15 min. A relay cut off from Kafka cannot end its
    open transaction, which pins the last stable offset of every partition it wrote, and
    ``read_committed`` readers see nothing there, a healthy peer's records included. The
    broker aborts it this long after it began (and its next check of timed-out
    transactions, every 10 s by default), so about when the relay's session ends, not a
    minute later; a peer that takes the part over aborts it at once (issue #49)."""
    return min(_MAX_TRANSACTION_TIMEOUT_S, max(_MIN_TRANSACTION_TIMEOUT_S, session_timeout_s))


def transactional_config(
    config: Mapping[str, Any], transactional_id: str, transaction_timeout_s: float
) -> dict[str, Any]:
    """``config`` for a transactional producer of ``transactional_id``. librdkafka
    refuses a ``message.timeout.ms`` (alias ``delivery.timeout.ms``) or a
    ``socket.timeout.ms`` above the transaction timeout: delivery_timeout's, or the
    operator's, are capped to it."""
    timeout_ms = int(transaction_timeout_s * 1000)
    capped = ("message.timeout.ms", "delivery.timeout.ms", "socket.timeout.ms")
    return {
        **config,
        **{key: min(int(config[key]), timeout_ms) for key in capped if key in config},
        "transactional.id": transactional_id,
        "transaction.timeout.ms": timeout_ms,
    }


def producer_config(
    bootstrap_servers: str,
    overrides: Mapping[str, Any],
    delivery_timeout_ms: int,
    *,
    delivery: str = "transactional",
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers,
        # An idempotent batch's records are visible once acknowledged, but with a linger
        # they waited in the client while the part read ahead, until the flush (p50 at
        # 1k ev/s: 1.77 ms at 5, 1.29 at 0). A transaction's are visible only at its
        # commit, which flushes them anyway (no gain measured at 0).
        "linger.ms": 0 if delivery == "idempotent" else 5,
        # librdkafka speaks the pre-KIP-890 transaction protocol: a transaction begun
        # right after a commit gets CONCURRENT_TRANSACTIONS until the broker has written
        # the last one's markers, and the default 100 ms backoff then dominated latency
        # (Kafka 4.1, 1k ev/s: p90 83 ms at 100, 10 ms at 10).
        "retry.backoff.ms": 10,
        # Same key → partition mapping as the Java client (and so Kafka Connect/Debezium).
        "partitioner": "murmur2_random",
        "message.timeout.ms": delivery_timeout_ms,
        # A broker that was down for a while is otherwise retried only every 10 s: after
        # a rolling restart it leads again and its partitions waited that long.
        "reconnect.backoff.max.ms": 1000,
        **overrides,
    }
    # Not negotiable: without these, retries may reorder or duplicate within a key.
    # One request in flight per broker: with more, a batch refused as "not leader" (a
    # partition just created, or whose leader just moved) was counted delivered when a
    # later batch of the same producer succeeded ("implicitly acked") while the broker,
    # holding no state for the producer there, took that later batch as the first: the
    # earlier records were lost, and a transaction committed without them (seen in CI;
    # confluentinc/confluent-kafka-go#921). One in flight retries the refused batch first.
    config.update(
        {"enable.idempotence": True, "acks": "all", "max.in.flight.requests.per.connection": 1}
    )
    return config


class TopicCreator:
    """Makes sure of the topics the relay publishes to, once per process: creates what
    is missing (when ``enabled``), and confines the topics rows choose (issue #17, item
    7; issue #47; docs/design.md §7, "Rows name topics"):

    * the operator's and the relay's own topics (:meth:`ensure`, and records not
      ``routed``: a fixed topic, one a filter names, the checkpoint and dead-letter
      topics) are created whatever ``max_created`` says, and never count against it;
    * a topic a row chose (a record ``routed``) that exists must be one this outbox
      created (in ``record``) or one ``allow_listed``: another may be another outbox's,
      and is refused (:class:`TopicRefused`, the row's poison);
    * a topic a row chose that does not exist is reserved in ``record``, where at most
      ``max_created`` such topics are (counted in Postgres under a lock: exact across
      processes, restarts and replicas), then created. With no room left, or no record
      (a schema before migration 0017), it waits (:class:`TopicBudgetFull`, retried):
      the relay's configuration, never the row's fault;
    * without creation (``enabled`` false), a missing topic, the operator's or a row's,
      waits until the operator creates it (:class:`TopicMissing`, retried; issue #48).

    ``record`` None (the demo's and the tests' own creators) keeps no record: no topic
    a row chose is refused for existing, and none is created."""

    def __init__(
        self,
        admin_config: Mapping[str, Any],
        *,
        enabled: bool = True,
        partitions: int = 3,
        replication_factor: int = -1,
        max_created: int | None = None,
        relay_owned: Callable[[str], bool] = lambda topic: False,
        record: TopicRecord | None = None,
        allow_listed: Callable[[str], bool] = lambda topic: False,
        admin: Callable[[], AdminClient] | None = None,
    ) -> None:
        """``admin``: the relay's admin client (relay/adapters/kafka/admin.py); None:
        one of the creator's own, for ``admin_config``."""
        self._admin_config = dict(admin_config)
        self._shared_admin = admin
        self._enabled = enabled
        self._partitions = partitions
        self._replication = replication_factor
        self._max_created = max_created
        self._relay_owned = relay_owned
        self._record = record
        self._allow_listed = allow_listed
        self._known: set[str] = set()
        self._lock = threading.Lock()  # shared by every worker of the relay
        self._client: AdminClient | None = None

    def known(self) -> frozenset[str]:
        """The topics this relay's publishers have made sure of: those they write to."""
        # Copying a set is one step under the GIL; no lock (creating topics holds it).
        return frozenset(self._known)

    def ensure(self, topics: set[str], *, partitions: int | None = None, **config: str) -> None:
        """Create what is missing of ``topics`` (the operator's or the relay's own).
        Raises :class:`TopicRefused` for the first topic refused for good, after
        creating the others."""
        self._ensure(topics, set(), partitions, config)

    def ensure_for_records(self, topics: set[str], routed: set[str]) -> None:
        """:meth:`ensure` for the topics of records, ``routed`` those that rows chose
        (confined as the class says). When creation is disabled, a missing topic raises
        :class:`TopicMissing`: the operator's to create, and retried until it exists."""
        self._ensure(topics, routed, None, {})

    def _ensure(
        self, topics: set[str], routed: set[str], partitions: int | None, config: dict[str, str]
    ) -> None:
        missing = topics - self._known
        if not missing:
            return
        with self._lock:
            missing -= self._known
            chosen = missing & routed
            if missing - chosen:
                self._ensure_declared(missing - chosen, partitions, config)
            if chosen:
                self._confine(chosen)

    def _ensure_declared(
        self, missing: set[str], partitions: int | None, config: dict[str, str]
    ) -> None:
        if not self._enabled:  # the operator's to create: the part waits for it
            absent = missing - self._existing(self._admin())
            self._known |= missing - absent
            if absent:
                raise TopicMissing(min(absent), _create_it(min(absent)))
            return
        created, refused = self._create_topics(self._admin(), missing, partitions, config)
        if self._record is not None:
            ours = {t for t in created if not self._relay_owned(t)}
            self._record.record(ours, TopicOrigin.DECLARED)
        try:
            if refused:
                raise refused[0]
        finally:
            del refused  # no cycle through the raised failure: see _confine

    def _confine(self, chosen: set[str]) -> None:
        """Make sure of topics rows chose; raises for the first refused (the row's
        poison), then :class:`TopicBudgetFull` for one that must wait."""
        admin = self._admin()
        existing = self._existing(admin)
        recorded = None if self._record is None else self._record.recorded()
        refused: list[TopicRefused] = []
        new = []
        for topic in sorted(chosen):
            if topic not in existing:
                new.append(topic)
            elif recorded is None or topic in recorded or self._allow_listed(topic):
                self._known.add(topic)
            else:
                refused.append(TopicRefused(topic, _NOT_OURS, creating=False))
        waiting: RelayError | None = None
        if new and not self._enabled:
            topic = new[0]
            unnamed = recorded is not None and not self._allow_listed(topic)
            waiting = TopicMissing(topic, _create_it(topic) + (_NAME_IT if unnamed else ""))
        elif new:
            wanted, waiting = self._reserve(new, recorded)
            refused += self._create_reserved(admin, wanted)
        try:
            if refused:
                raise refused[0]
            if waiting is not None:
                raise waiting
        finally:
            # Raised, a failure's traceback holds this frame, whose locals held it: a
            # cycle keeping the caller's publisher and its client's threads until the
            # cyclic collector, which a relay runs rarely (#53).
            del refused, waiting

    def _create_reserved(self, admin: AdminClient, wanted: list[str]) -> list[TopicRefused]:
        """Create the topics ``_reserve`` made room for; a refused one's room is given
        back. Returns the refusals."""
        failed = self._create_topics(admin, set(wanted), None, {})[1]
        for failure in failed:
            assert self._record is not None  # only a record reserves
            self._record.release(failure.topic)  # no room taken by a refused name
        return failed

    def _reserve(
        self, new: list[str], recorded: frozenset[str] | None
    ) -> tuple[list[str], TopicBudgetFull | None]:
        """The topics of ``new`` to create: this outbox's already (deleted since), or
        reserved now; and the wait for the first that found no room."""
        wanted: list[str] = []
        waiting = None
        for topic in new:
            if recorded is not None and topic in recorded:
                wanted.append(topic)
                continue
            reserved = (
                None if self._record is None else self._record.reserve(topic, self._max_created)
            )
            if reserved:
                wanted.append(topic)
            elif waiting is None:
                waiting = TopicBudgetFull(topic, self._no_room(reserved))
        return wanted, waiting

    def _no_room(self, reserved: bool | None) -> str:
        if reserved is None:
            return (
                "the outbox keeps no record of the topics it creates before migration 0017: "
                "run `outbox-relay migrate`"
            )
        return (
            f"max_created_topics ({self._max_created}) topics were created for rows already: "
            "raise max_created_topics, or confine the subscriber's topics (a filter that "
            "lists the values, or topic_allow); the part goes on once there is room"
        )

    def _admin(self) -> AdminClient:
        """The creator's one admin client, opened on first use (callers hold the lock):
        one per call was a client of 4-5 threads for each part making sure of its topics
        (issue #53)."""
        if self._shared_admin is not None:
            return self._shared_admin()
        if self._client is None:
            client: dict[str, Any] = {**self._admin_config, "logger": _client_log}
            self._client = AdminClient(client)
        return self._client

    def _existing(self, admin: AdminClient) -> set[str]:
        try:
            return set(admin.list_topics(timeout=10).topics)
        except KafkaException as exc:
            raise classify(exc, "cannot list topics") from exc

    def _create_topics(
        self, admin: AdminClient, missing: set[str], partitions: int | None, config: dict[str, str]
    ) -> tuple[set[str], list[TopicRefused]]:
        """Create ``missing``: the topics created (not those that existed already), and
        those refused for good."""
        created: set[str] = set()
        refused: list[TopicRefused] = []
        if not missing:
            return created, refused
        futures = admin.create_topics(
            [
                NewTopic(
                    t,
                    num_partitions=partitions or self._partitions,
                    replication_factor=self._replication,
                    config=config,
                )
                for t in sorted(missing)
            ],
            operation_timeout=10,
            request_timeout=15,
        )
        for topic, future in futures.items():
            # Its exception, not raised: raised, the future's exception took this frame
            # into its traceback, and this frame holds the future, a cycle only the
            # garbage collector frees. Every caller's frame was held with it, the part's
            # publisher and its clients' threads too: each of 1,000 parts did so once,
            # its topic existing already (issue #53).
            error = future.exception()
            if error is None:
                created.add(topic)
                logger.info(
                    "created topic %s", topic, extra=log_extra("kafka_topic_created", topic=topic)
                )
            elif (failure := _creation_failure(error, topic)) is not None:
                if isinstance(failure, TopicRefused):
                    refused.append(failure)
                    continue
                try:
                    raise failure from error
                finally:
                    del failure  # raised, it holds this frame: the same cycle
            self._known.add(topic)
        return created, refused


def _creation_failure(error: BaseException, topic: str) -> RelayError | None:
    """What a topic's creation future's ``error`` means; None: the topic exists."""
    if isinstance(error, KafkaException):
        return classify(error, topic, Stage.CREATE_TOPIC)
    # Not the client's own kind: nothing to read but its text, retried as classify
    # retries any creation failure without a code.
    return BrokerUnavailable(f"cannot create topic {topic!r}: {error}")


def _create_it(topic: str) -> str:
    """Why ``topic`` waits without creation, and the command that ends the wait."""
    return (
        "it does not exist and create_topics is false: create it "
        f"(`outbox-relay topics create {topic} --if-not-exists`)"
    )


# A row's topic the outbox did not create must be named too (issue #47).
_NAME_IT = (
    ", and name it in topic_allow (or list its type in the subscriber's filter): rows "
    "reach only the topics this outbox created or that are named"
)

# Why a row may not publish to an existing topic outside the outbox's record.
_NOT_OURS = (
    "it exists, but this outbox did not create it, no filter names it and topic_allow "
    "does not match it: it may be another outbox's topic. To publish there, list it in "
    "topic_allow (or the type in the subscriber's filter)"
)


class _BatchProducer:
    """Produce a batch and wait for every delivery report (shared by both modes)."""

    def __init__(
        self,
        config: dict[str, Any],
        topics: TopicCreator,
        delivery_timeout_s: float,
    ) -> None:
        self._config = config
        self._topics = topics
        self._delivery_timeout_s = delivery_timeout_s
        self._producer = self._new_producer()
        self._partition_counts: dict[str, int] = {}  # for records with a chosen partition

    def _new_producer(self) -> Producer:
        try:
            return Producer(self._config, logger=_client_log)
        except KafkaException as exc:
            raise classify(exc, "kafka: invalid producer configuration", Stage.CONFIGURE) from exc

    def _send(
        self,
        records: Sequence[KafkaRecord],
        meanwhile: Meanwhile | None = None,
        *,
        wait: bool = True,
    ) -> tuple[list[KafkaRecord], Position | None]:
        """Produce ``records``, run ``meanwhile`` (and produce its extension), then
        (``wait``) wait until each record is acknowledged or failed. Without ``wait`` no
        delivery reports are asked for: the caller learns of failures otherwise (a
        transaction's commit fails). Returns every record sent and the extension's end."""
        failures: list[tuple[Message, KafkaError]] = []

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failures.append((msg, err))

        sent = self._produce_all(records, delivered if wait else None)
        extension = meanwhile() if meanwhile is not None else None
        if extension is not None:
            sent += self._produce_all(extension[0], delivered if wait else None)
        if wait:
            self._wait()
            if failures:
                self._raise_for(sent, failures)
        return sent, extension[1] if extension is not None else None

    def _produce_all(
        self, records: Sequence[KafkaRecord], callback: Callable[..., None] | None
    ) -> list[KafkaRecord]:
        topics = set(map(_topic_of, records))
        routed = set(itertools.compress(map(_topic_of, records), map(_routed_of, records)))
        try:
            self._topics.ensure_for_records(topics, routed)
        except TopicRefused as exc:
            # The first record bound for it takes the blame; the poison policy decides.
            record = next(r for r in records if r.topic == exc.topic)
            raise PoisonRecordError(record, f"topic refused: {exc.reason}") from exc
        except TopicMissing as exc:
            if exc.topic not in routed:
                raise  # the operator's topic: every part bound for it waits
            # A row's: 'halt' waits for it, 'dead-letter' takes the row as poison.
            record = next(r for r in records if r.topic == exc.topic)
            raise PoisonRecordError(record, f"topic refused: {exc.reason}", wait=exc) from exc
        self._check_sizes(records)
        self._check_partitions(records)
        self._produce_each(records, callback)
        return list(records)

    def _check_partitions(self, records: Sequence[KafkaRecord]) -> None:
        """Refuse a record whose chosen partition its topic does not have (its row's
        poison): librdkafka would fail it only at delivery, and the batch with it."""
        if set(map(_PARTITION, records)) == {None}:  # the usual batch: one C-level pass
            return
        for record in records:
            if record.partition is None:
                continue
            count = self._partition_counts.get(record.topic, 0)
            if record.partition >= count:  # unknown, or grown since: look again
                count = self._partition_count(record.topic)
            # 0: not there yet; producing waits for it, as for any record.
            if 0 < count <= record.partition:
                raise PoisonRecordError(
                    record,
                    f"partition {record.partition} does not exist: topic {record.topic!r} "
                    f"has {count} partitions",
                )

    def _partition_count(self, topic: str) -> int:
        try:
            found = self._producer.list_topics(topic, timeout=self._delivery_timeout_s)
        except KafkaException as exc:
            raise classify(exc, f"cannot describe topic {topic!r}") from exc
        described = found.topics.get(topic)
        count = 0 if described is None or described.error else len(described.partitions)
        self._partition_counts[topic] = count
        return count

    def _check_sizes(self, records: Sequence[KafkaRecord]) -> None:
        """Refuse an oversized record before producing anything, so a transaction is
        not begun and then aborted over a rejection we can predict."""
        limit = int(self._config.get("message.max.bytes", 1_000_000))
        sizes = list(map(_size_of, records))  # as the encoder counted them: no call each
        if sizes and min(sizes) >= 0 and max(sizes) <= limit:
            return
        for record in records:
            if (size := record.byte_size()) > limit:
                raise PoisonRecordError(
                    record, f"record too large: {size} bytes > message.max.bytes ({limit})"
                )

    def _produce_each(
        self, records: Sequence[KafkaRecord], callback: Callable[..., None] | None
    ) -> None:
        """``produce()`` every record, in order: one loop, the client's method bound once,
        rather than a method of ours called per record around it."""
        produce = self._producer.produce
        # A delivery report costs a Python call per record: asked for only when needed.
        report: dict[str, Any] = {"on_delivery": callback} if callback is not None else {}
        done = 0
        while done < len(records):
            record = records[done]
            try:
                for record in itertools.islice(records, done, None):
                    if record.timestamp_ms is None and record.partition is None:
                        produce(
                            record.topic, record.value, record.key, headers=record.headers, **report
                        )
                    else:
                        produce(
                            record.topic,
                            record.value,
                            record.key,
                            headers=record.headers,
                            # produce()'s own defaults: the producer's clock, the partitioner.
                            timestamp=record.timestamp_ms or 0,
                            partition=-1 if record.partition is None else record.partition,
                            **report,
                        )
                    done += 1
            except BufferError:
                self._producer.poll(0.05)  # local queue full: let deliveries drain
            except KafkaException as exc:
                context = f"cannot produce to {record.topic!r}"
                raise classify(exc, context, Stage.PRODUCE, record=record) from exc

    def _wait(self) -> None:
        # One producer per part, so the producer's queue is exactly this batch.
        # message.timeout.ms bounds every record, so each gets a delivery report; the
        # deadline only protects against a wedged client.
        deadline = time.monotonic() + self._delivery_timeout_s * 2 + 10
        while (remaining := self._flush(1.0)) > 0:
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"{remaining} records unacknowledged after the delivery timeout"
                )

    def _flush(self, timeout: float) -> int:
        try:
            return _flush_unwrapped(self._producer, timeout)
        except KafkaException as exc:  # a fatal producer error surfaces here
            raise classify(exc, "waiting for acknowledgements", Stage.DELIVERY) from exc

    def _raise_for(
        self, records: Sequence[KafkaRecord], failures: list[tuple[Message, KafkaError]]
    ) -> None:
        rejected = [(msg, error) for msg, error in failures if rejects_record(error)]
        if rejected:
            msg, error = rejected[0]
            raise PoisonRecordError(
                _matching(records, msg), error.str(), ambiguous=len(rejected) > 1
            )
        context = f"{len(failures)} records not acknowledged"
        raise classify(failures[0][1], context, Stage.DELIVERY)

    def close(self) -> None:
        try:
            remaining = _flush_unwrapped(self._producer, min(self._delivery_timeout_s, 5.0))
        except KafkaException as exc:
            logger.debug(
                "closing a failed producer: %s",
                exc,
                extra=log_extra("kafka_producer_close_failed", error=exc),
            )
            return
        if remaining:
            logger.warning(
                "closing with %s records unacknowledged",
                remaining,
                extra=log_extra("kafka_producer_closed_unacknowledged", unacknowledged=remaining),
            )


class IdempotentPublisher(_BatchProducer):
    """Idempotent producer: ordered per key; at-least-once across relay restarts."""

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        return None  # no Kafka-side checkpoint in this mode

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        self._send(batch.records, meanwhile)


class TransactionalPublisher(_BatchProducer):
    """One Kafka transaction per batch, with the checkpoint committed inside it."""

    def __init__(
        self,
        config: dict[str, Any],
        topics: TopicCreator,
        delivery_timeout_s: float,
        *,
        transactional_id: str,
        transaction_timeout_s: float,
        group_prefix: str,
        checkpoint_topic: str,
        groups: CheckpointGroups,
        calls: CallThread | None = None,
    ) -> None:
        """``groups``: where the checkpoint is read and its group's metadata made (a
        relay's publishers share them: :class:`~relay.adapters.kafka.publishers.
        PublisherFactory`). ``calls``: the thread this producer's transactional calls
        run on, which a part's two producers share (their calls never overlap but at
        recovery: :meth:`start_fence`); None: a thread of its own."""
        super().__init__(
            transactional_config(config, transactional_id, transaction_timeout_s),
            topics,
            delivery_timeout_s,
        )
        self.transactional_id = transactional_id
        self._call_timeout_s = min(delivery_timeout_s, _TXN_CALL_TIMEOUT_S)
        self._group_prefix = group_prefix
        self._checkpoint_topic = checkpoint_topic
        self._groups = groups
        self._initialised = False
        self._wedged = False
        # Why this producer takes no more transactions (an abort that failed), if so.
        self._unusable: str | None = None
        self._key_space: UUID | None = None
        # A call that hangs keeps it, and the producer is abandoned with it. It also
        # carries the calls that run while the caller does something else (a commit
        # while the next batch is read): call_thread.py.
        self._calls = calls if calls is not None else CallThread("kafka-txn-call")

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        """Fence every earlier producer of this part (aborting its open transaction),
        then read the checkpoint the last committed transaction recorded."""
        self.fence(key_space)
        return self.checkpoint(generation)

    def fence(self, key_space: UUID | None = None) -> None:
        """Fence every earlier producer of this transactional id: its open transaction
        is aborted, and none of its transactions can commit after this returns.
        ``key_space``: the database this producer's checkpoints are tagged with."""
        self.start_fence(key_space)()

    def start_fence(
        self, key_space: UUID | None = None, *, own_thread: bool = False
    ) -> Callable[[], None]:
        """Start :meth:`fence` on this producer's call thread, or with ``own_thread`` on
        one for this fence alone (beside the other producer's, which runs on the thread
        they share); the function returned waits for it (and raises as ``fence``)."""
        self._topics.ensure(
            {self._checkpoint_topic},
            partitions=CHECKPOINT_PARTITIONS,
            **{"cleanup.policy": "compact"},
        )
        calls = CallThread("kafka-txn-fence") if own_thread else self._calls
        fencing = self._started(
            (self._producer.init_transactions, (self._call_timeout_s,)), on=calls
        )

        def fenced() -> None:
            try:
                self._finish(fencing)
            finally:
                if own_thread:
                    calls.close()  # ends once its call returns, if it hung
            self._initialised = True
            self._key_space = key_space

        return fenced

    def checkpoint(self, generation: str) -> KafkaCheckpoint | None:
        """The checkpoint the last committed transaction recorded in this producer's
        group (a part's two producers share one). Read once every producer that commits
        to the group is fenced, it is the last there will be."""
        committed = self._groups.committed(
            self._group(generation), self._checkpoint_topic, self._delivery_timeout_s
        )
        first, second = sorted(committed, key=lambda tp: tp.partition)
        if first.offset < 0 or second.offset < 0:
            return None
        return _checkpoint(Position(first.offset, second.offset), first.metadata)

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        if not batch.records:  # nothing to publish; the Postgres checkpoint alone moves
            extension = meanwhile() if meanwhile is not None else None
            if extension is not None:
                self.publish(Batch(*extension, batch.generation), owned=owned)
            return
        assert self._initialised, "recover() first: it fences earlier producers"
        # On the fast path records are not awaited one by one: the commit flushes them
        # and fails if any failed. A backlog's batch (it promises not to grow) commits
        # while ``meanwhile`` reads the next one.
        overlapping = not batch.may_extend and meanwhile is not None
        sent = batch
        try:
            sent = self._send_in_transaction(batch, None if overlapping else meanwhile, wait=False)
            self._commit_batch(sent, meanwhile if overlapping else None)
        except TransactionAborted as exc:
            # A record failed, so the commit did not happen. Run the batch (as sent,
            # grown by what joined it) again with a delivery report per record: that
            # names the record at fault (a poison event), or succeeds if the failure
            # was passing.
            logger.info(
                "transaction aborted (%s); retrying with delivery reports",
                exc,
                extra=self._log_extra("kafka_txn_aborted_retrying", error=exc),
            )
            if owned is not None and not owned():
                raise ProducerFenced(
                    f"{self.transactional_id}: transaction aborted ({exc}) after this "
                    "relay's session lapsed: not fencing the part's producers again, "
                    "lest a peer that took it over be fenced and the batch published twice",
                    code=exc.code,
                ) from exc
            self._next_epoch()
            self._commit_batch(self._send_in_transaction(sent, None, wait=True), None)

    def _next_epoch(self) -> None:
        """Go on from an aborted transaction on a new client of this transactional id,
        whose init_transactions gives it the next epoch. At the same epoch a record whose
        outcome the client never learned (its leader killed as it appended it) may be
        sent again under its old sequence number: the broker answers it as a duplicate of
        the aborted batch and does not append it, and the retry commits without it (two
        events lost once in CI's cluster availability test). A new epoch starts the
        sequences over.
        librdkafka does not speak KIP-890, which bumps the epoch at every transaction."""
        self._producer = self._new_producer()  # the old one is destroyed once dropped
        self._call(self._producer.init_transactions, self._call_timeout_s)

    def _send_in_transaction(
        self, batch: Batch, meanwhile: Meanwhile | None, *, wait: bool
    ) -> Batch:
        """Begin a transaction and produce ``batch`` into it, grown by what ``meanwhile``
        hands back; returns the batch as sent. ``wait``: await every record's delivery
        report (a failure then names its record)."""
        self._call(self._producer.begin_transaction)
        try:
            records, extended_to = self._send(batch.records, meanwhile, wait=wait)
        except BaseException as exc:
            cause = self._purged_by(exc)
            self._abort()
            if cause is None:
                raise
            try:
                raise cause from exc
            finally:
                del cause  # raised, it holds this frame: no cycle through it (#53)
        end = extended_to or batch.end
        return Batch(records, end, batch.generation, dead_letters=batch.dead_letters)

    def _purged_by(self, failure: BaseException) -> AclRefused | None:
        """Why the client purged the records (``_PURGE_QUEUE``), when it is an ACL the
        transaction lacks: the transaction failed on its own (adding a topic the
        principal may not write), and the purge alone said only "Purged in queue", so a
        part waiting for an ACL showed as waiting for Kafka (#48). Inside a failed
        transaction librdkafka answers any transactional call with the transaction's
        error; begin_transaction changes nothing inside one."""
        if not isinstance(failure, BrokerUnavailable) or failure.code != KafkaError._PURGE_QUEUE:
            return None
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            cause = classify(exc, self.transactional_id, Stage.TRANSACTION, config=self._config)
            return cause if isinstance(cause, AclRefused) else None
        return None

    def _commit_batch(self, sent: Batch, during_commit: Callable[[], object] | None) -> None:
        """Commit the open transaction with ``sent``'s checkpoint; ``during_commit`` runs
        here while the commit travels on the call thread."""
        metadata = self._metadata(sent.generation)
        end = sent.end
        # librdkafka silently drops a negative offset from the commit: never send one.
        assert end.transaction_id >= 0 and end.position >= 0, end
        offsets = [
            TopicPartition(
                self._checkpoint_topic,
                0,
                end.transaction_id,
                metadata=checkpoint_tag(
                    sent.records, sent.dead_letters, self._key_space, self.transactional_id
                ),
            ),
            TopicPartition(self._checkpoint_topic, 1, end.position),
        ]
        if during_commit is None:
            self._commit(offsets, metadata)
        else:
            self._commit_overlapping(offsets, metadata, during_commit)

    def _commit(self, offsets: list[TopicPartition], metadata: Any) -> None:
        self._finish(self._start_commit(offsets, metadata))

    def _start_commit(self, offsets: list[TopicPartition], metadata: Any) -> Steps:
        timeout = self._call_timeout_s
        return self._started(
            (self._producer.send_offsets_to_transaction, (offsets, metadata, timeout)),
            (self._producer.commit_transaction, (timeout,)),
        )

    def _commit_overlapping(
        self, offsets: list[TopicPartition], metadata: Any, during: Callable[[], object]
    ) -> None:
        """Commit on the call thread while ``during`` runs on this one. A backlog's
        batches then cost the larger of the two, not their sum: the commit's round trips
        (offsets to the group coordinator, then EndTxn) mostly wait on the broker. The
        commit's outcome wins: a failed commit is raised even if ``during`` failed too."""
        committing = self._start_commit(offsets, metadata)
        try:
            during()
        finally:
            self._finish(committing)

    def close(self) -> None:
        self._calls.close()  # a hung call's thread ends if the call ever returns
        # No flush: a record still queued belongs to a transaction that failed (or never
        # committed), which the next producer's init_transactions aborts. Waiting up to
        # 5 s for its delivery only lengthened the part's gap when a leader died; and a
        # wedged producer's flush would hang as well.

    def _metadata(self, generation: str) -> Any:
        """The checkpoint group's metadata for ``generation`` (a reset starts a new one)."""
        return self._groups.metadata(self._group(generation))

    def _group(self, generation: str) -> str:
        # Named after the checkpoint generation: a reset starts a new group, so offsets
        # from before it can never be mistaken for progress after it.
        return f"{self._group_prefix}.{generation}"

    def _watched(self, operation: Callable[..., object], *args: Any) -> None:
        """``operation(*args)``, given up on when it outlives its own timeout.

        librdkafka's transactional calls take a timeout but do not always honour it:
        after the broker (the coordinator) restarts, send_offsets_to_transaction and
        commit_transaction can block for good (librdkafka issues 5511, 3779; seen here in
        the chaos suite). The call then runs on the producer's call thread; past its
        timeout plus a grace period the producer is abandoned, and the part starts over
        with a new one (whose init_transactions fences the stuck one).
        """
        self._await(self._started((operation, args)))

    def _started(self, *steps: Step, on: CallThread | None = None) -> Steps:
        """``steps`` handed to the call thread (or ``on``), to run in order while this
        thread goes on; :meth:`_finish` waits for them, each watched as
        :meth:`_watched` says."""
        if self._wedged:
            raise ProducerFenced(f"{self.transactional_id}: producer abandoned (a call hung)")
        if self._unusable is not None:
            raise BrokerUnavailable(self._unusable)
        return (on or self._calls).start(steps)

    def _await(self, steps: Steps) -> None:
        """Wait for ``steps``: the failure of the step that failed is raised as it was."""
        limit = self._call_timeout_s + _CALL_GRACE_S
        hung = steps.wait(limit)
        if hung is not None:
            self._log_if_slow(hung, limit, " (given up)")
            raise self._abandon(hung, limit)
        failure = steps.failure
        for index, (operation, took) in enumerate(steps.took):
            failed = failure is not None and index == len(steps.took) - 1
            self._log_if_slow(operation, took, f" ({failure})" if failed else "")
        if failure is not None:
            try:
                raise failure
            finally:
                # Its traceback holds this frame and the steps': without these the
                # cycles kept the publisher and its client's threads until the cyclic
                # collector, rare in a relay (tune_gc): 1,000 parts ran hundreds of
                # closed clients (#53).
                steps.failure = None
                del steps, failure

    def _finish(self, steps: Steps) -> None:
        """Wait for ``steps`` started ahead (:meth:`_started`). A step that failed goes
        on as :meth:`_call` makes a call that failed (classified, made again while its
        error may pass), then the steps after it, each through ``_call``."""
        failed: KafkaException | None = None
        try:
            try:
                self._await(steps)
                return
            except KafkaException as exc:
                failed = exc
            operation, args = steps.steps[steps.failed_step]
            self._call(operation, *args, failed=failed)
            for operation, args in steps.steps[steps.failed_step + 1 :]:
                self._call(operation, *args)
        finally:
            failed = None  # raised or made again, it holds this frame: no cycle (#53)

    def _abandon(self, hung: Callable[..., object], limit: float) -> ProducerFenced:
        """Give up this producer (and its call thread, blocked in ``hung``)."""
        self._wedged = True
        _abandoned.append(self._producer)  # never destroyed: that would block too
        return ProducerFenced(
            f"{self.transactional_id}: {_name(hung)} did not "
            f"return within {limit:.0f}s; starting the part over with a new producer"
        )

    def _log_if_slow(self, operation: Callable[..., object], took: float, outcome: str) -> None:
        if took >= _SLOW_CALL_S:  # where a part's publishing gap goes (issue #29)
            name = _name(operation)
            with _SLOW_CALLS_LOCK:
                first = _SLOW_CALLS.allows()
            logger.log(
                logging.INFO if first else logging.DEBUG,
                "%s: %s took %.1fs%s",
                self.transactional_id,
                name,
                took,
                outcome,
                extra=self._log_extra("kafka_txn_call_slow", call=name, seconds=round(took, 2)),
            )

    def _abort(self) -> None:
        try:
            self._watched(self._producer.abort_transaction, self._call_timeout_s)
        except ProducerFenced as exc:
            self._give_up_producer(exc)
        except KafkaException as exc:
            self._give_up_producer(
                classify(exc, self.transactional_id, Stage.TRANSACTION, config=self._config)
            )

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this producer's log lines: the event, its transactional id
        (which names its part), then ``fields``."""
        return log_extra(event, transactional_id=self.transactional_id, **fields)

    def _give_up_producer(self, failure: RelayError) -> None:
        """After a failed abort. The next producer's init_transactions aborts it for us.
        This one takes no more: its abort may still be in progress, and a transaction
        begun on it failed with "Conflicting abort_transaction API call is already in
        progress" (a rolling restart, #29), a round trip wasted. Whatever the abort's
        error, the part then starts over, so its call raises BrokerUnavailable."""
        logger.warning(
            "could not abort the transaction: %s",
            failure,
            extra=self._log_extra("kafka_txn_abort_failed", error=failure),
        )
        self._unusable = (
            f"{self.transactional_id}: could not abort the transaction ({failure}); "
            "starting the part over with a new producer"
        )

    def _call(
        self, operation: Callable[..., object], *args: Any, failed: KafkaException | None = None
    ) -> None:
        """Run a transaction API call, mapping librdkafka's error flags onto ours.
        ``failed``: the call was made already (:meth:`_finish`), and failed so."""
        deadline = time.monotonic() + self._delivery_timeout_s
        failure: RelayError | None = None
        first: KafkaException | None = None
        try:
            while True:
                try:
                    if failed is None:
                        self._watched(operation, *args)
                        return
                    first, failed = failed, None
                    raise first
                except KafkaException as exc:
                    failure = classify(
                        exc, self.transactional_id, Stage.TRANSACTION, config=self._config
                    )
                    if isinstance(failure, TransactionAborted):
                        self._abort()
                    if not retry_now(failure) or time.monotonic() > deadline:
                        raise failure from exc
                    if self._initialised and coordinator_moved(failure):
                        # Mid-transaction, its coordinator gone: made again here, the
                        # call hung for the watchdog's whole bound in a node kill (#29).
                        # The part starts over with a new producer instead, whose
                        # init_transactions finds the new coordinator and aborts this
                        # transaction.
                        raise failure from exc
                    time.sleep(0.1)
        finally:
            # Cycles through the traceback, as in _await (#53).
            failure = first = failed = None


def checkpoint_tag(
    sent: Sequence[KafkaRecord],
    dead_letters: Sequence[tuple[Position, str]],
    key_space: UUID | None,
    transactional_id: str,
) -> str:
    """A checkpoint's provenance: its key space and the last message published, so a
    later owner can tell whether the checkpoint belongs to the database it serves; and
    the transaction's dead letters, so that an owner that adopts it records their
    decisions as this one would have (docs/design.md §7)."""
    message = sent[-1].outbox_message_id if sent else None
    space = str(key_space) if key_space is not None else None
    tag: dict[str, Any] = {"key_space": space, "message_id": message}
    text = json.dumps({**tag, **dead_letter_tag.fields(dead_letters)}, separators=(",", ":"))
    if len(text) > _MAX_TAG_BYTES:  # the worker keeps it well under: never refused
        logger.warning(
            "checkpoint tag too long: its %d dead letters left out",
            len(dead_letters),
            extra=log_extra(
                "kafka_checkpoint_tag_too_long",
                transactional_id=transactional_id,
                dead_letters=len(dead_letters),
            ),
        )
        text = json.dumps(tag, separators=(",", ":"))
    return text


def _name(operation: Callable[..., object]) -> str:
    return getattr(operation, "__name__", "a call")


def _flush_unwrapped(producer: Producer, timeout: float) -> int:
    """``producer.flush``, with one client quirk undone: when a fenced producer runs a
    Python delivery callback during flush, confluent-kafka 2.16 raises ``SystemError``
    chained from the real ``KafkaException``."""
    try:
        return producer.flush(timeout)
    except SystemError as exc:
        if isinstance(exc.__cause__, KafkaException):
            raise exc.__cause__ from exc
        raise


def _checkpoint(position: Position, metadata: str | None) -> KafkaCheckpoint:
    """A Kafka-side checkpoint with its provenance; an unreadable tag (an older relay
    wrote none) reads as unknown."""
    try:
        tag = json.loads(metadata or "{}")
        space, message = tag.get("key_space"), tag.get("message_id")
        provenance = KafkaCheckpoint(
            position, UUID(space) if space else None, UUID(message) if message else None
        )
    except (ValueError, TypeError, AttributeError):
        return KafkaCheckpoint(position)
    try:
        return provenance._replace(
            dead_letters=dead_letter_tag.read(tag), named_dead_letters=_named(tag)
        )
    except (ValueError, TypeError, AttributeError, IndexError) as exc:
        # Its provenance still holds: the checkpoint may be adopted, without decisions.
        logger.warning(
            "the Kafka-side checkpoint at %s names dead letters that cannot be read (%s): "
            "an owner that adopts it records none of them",
            position,
            exc,
            extra=log_extra("kafka_checkpoint_tag_unreadable", error=exc),
        )
        return provenance


def _named(tag: dict[str, Any]) -> tuple[tuple[UUID, str], ...]:
    """Dead letters by message id, as relays before issue #47 named them."""
    topics = tag.get(dead_letter_tag.TOPICS, [])
    return tuple((UUID(m), str(topics[i])) for m, i in tag.get(dead_letter_tag.NAMED, []))


_topic_of = operator.attrgetter("topic")
_size_of = operator.attrgetter("size")
_routed_of = operator.attrgetter("routed")


def _matching(records: Sequence[KafkaRecord], msg: Message) -> KafkaRecord:
    """The record a failed delivery report is about. Delivery reports carry no headers
    (confluent-kafka leaves them out), so it is matched by topic, key and value: the
    ``id`` header alone matched nothing, and the batch's first record took the blame
    (and its dead letter) for another's rejection. Records alike in all three are
    rejected alike, so either is the culprit."""
    wanted = (msg.topic(), msg.key(), msg.value())
    for record in records:
        if (record.topic, record.key, record.value) == wanted:
            return record
    return records[0]
