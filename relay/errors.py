"""The single error hierarchy of outbox-relay.

Every error the package raises derives from :class:`RelayError`. Errors that a
caller (or the relay's own loop) may retry after a pause derive from
:class:`RetryableError`; everything else is fatal for the operation at hand.
Driver errors are wrapped with ``raise ... from exc`` so the cause stays visible, each
driver at one place: :func:`relay.adapters.postgres.db.wrap_errors` for Postgres (psycopg), and
:func:`relay.adapters.kafka.kafka_errors.classify` for Kafka (confluent-kafka). See "Errors" in
docs/design.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.core.model import KafkaRecord


class RelayError(Exception):
    """Base class of every outbox-relay error. ``waits_on`` names what a running part
    waits for when it meets this error (``outbox_relay_part_waiting`` shows it per part):
    a service it cannot reach, or a fix that heals it without a restart (a privilege, an
    ACL, a topic); None when the part does not wait for it."""

    waits_on: str | None = None


class RetryableError(RelayError):
    """A transient fault: the same operation may succeed later. ``waits_on`` names the
    service whose absence it means; None when it is no outage (a conflict, say)."""


class ConfigError(RelayError):
    """Invalid settings; the message names the offending key."""


class SchemaIncompatible(ConfigError):
    """The schema registry refused a local writer schema under a subject (incompatible
    with the subject's history, or invalid): the schemas or the registry's rules must
    change; no event is at fault."""


class SchemaError(RelayError):
    """An Avro schema file is missing, unreadable or invalid."""


class PayloadValidationError(RelayError):
    """A payload does not match its event's Avro schema."""

    def __init__(self, event_type: str, problems: list[str]) -> None:
        self.event_type = event_type
        self.problems = problems
        super().__init__(
            f"payload for event type {event_type!r} is invalid: " + "; ".join(problems)
        )


class UnknownEventTypeError(PayloadValidationError):
    """No Avro schema in the registry describes this event type."""

    def __init__(self, event_type: str) -> None:
        super().__init__(event_type, [f"no schema for event type {event_type!r} in the registry"])


class ConcurrencyError(RetryableError):
    """An append lost a race (a stale stream version, a serialization failure, a
    deadlock): the transaction is rolled back; retry the whole application transaction.
    ``sqlstate`` is Postgres's code when Postgres said so, None when the relay did."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


class IdempotencyKeyReused(RelayError):
    """An append came with an idempotency key this writer already used for another event
    (another event type or payload) of the same aggregate. Nothing was written, the first
    event stays, and the caller's transaction is still usable: a retry must repeat its
    event, and a new event needs a new key. ``message_id`` is the first event's."""

    def __init__(
        self, aggregate_type: str, aggregate_id: str, idempotency_key: str, message_id: str
    ) -> None:
        self.aggregate_type = aggregate_type
        self.aggregate_id = aggregate_id
        self.idempotency_key = idempotency_key
        self.message_id = message_id
        super().__init__(
            f"idempotency key {idempotency_key!r} of {aggregate_type}/{aggregate_id} was "
            f"used for another event (message {message_id}): nothing was appended; a "
            "retry must append the same event type and payload, a new event needs a new key"
        )


class StreamConflict(ConcurrencyError):
    """An event-sourced append to one stream (``aggregate_type``/``aggregate_id``) did not
    fit the stream's versions: ``expected_version`` was stale or ahead of it."""

    problem = "does not fit the stream"

    def __init__(
        self,
        aggregate_type: str,
        aggregate_id: str,
        expected_version: int,
        *,
        sqlstate: str | None = None,
    ) -> None:
        self.aggregate_type = aggregate_type
        self.aggregate_id = aggregate_id
        self.expected_version = expected_version
        super().__init__(
            f"stream {aggregate_type}/{aggregate_id}: expected version {expected_version} "
            f"{self.problem}",
            sqlstate=sqlstate,
        )


class StaleStreamVersion(StreamConflict):
    """A concurrent append wrote the version after ``expected_version`` first."""

    problem = "is stale, a concurrent append wrote the next version first"


class StreamVersionAhead(StreamConflict):
    """The stream has no version ``expected_version`` (the outbox's stream-order trigger
    refused the append)."""

    problem = "is ahead of the stream"


class DatabaseError(RelayError):
    """A Postgres error that retrying will not fix (permissions, missing schema, ...).
    ``sqlstate`` is Postgres's code for it (None when the driver gave none)."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


class DatabaseUnavailable(RetryableError):
    """Postgres is unreachable or the connection broke."""

    waits_on = "postgres"

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


class PrivilegeMissing(DatabaseError):
    """The role lacks a privilege (42501; not a row-level security policy's refusal):
    ``outbox-relay grant`` restores it. A command, or a relay starting, ends on it: the
    operator is there to run the grant. A running relay's part waits for it and goes on
    once it is granted again: a grant revoked heals, so it never halts a part (#48)."""

    waits_on = "postgres_privilege"


class LockTimeout(RetryableError):
    """A lock another session holds was not granted in time (the migration lock, say);
    the message names that session."""

    waits_on = "postgres"


class SchemaOpenToPublic(DatabaseError):
    """Every role may CREATE in the relay's own schema (Postgres before 15 lets PUBLIC
    create in `public`): ``migrate`` and ``grant`` refuse it unless allowed."""


class UndefinedTableError(DatabaseError):
    """A statement named a table the database does not have."""


class NotMigratedError(UndefinedTableError):
    """The outbox tables are missing or older than this code: run ``outbox-relay migrate``."""


class UndefinedFunctionError(DatabaseError):
    """A statement called a function the database does not have (on the relay's own
    functions: a schema from before the migration that added it)."""


class BrokerError(RelayError):
    """A Kafka error that retrying will not fix. ``code`` is the client's error code
    (``confluent_kafka.KafkaError``), None when the relay itself refused."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        self.code = code
        super().__init__(message)


class TopicRefused(BrokerError):
    """A row may not publish to a topic, for good: its name is illegal or collides, a
    policy refuses it, or it exists but is another's (neither this outbox's nor allowed,
    issue #47). Publishing the row is that row's poison."""

    def __init__(
        self, topic: str, reason: str, *, code: int | None = None, creating: bool = True
    ) -> None:
        self.topic = topic
        self.reason = reason
        what = "cannot create topic" if creating else "may not publish to topic"
        super().__init__(f"{what} {topic!r}: {reason}", code=code)


class BrokerUnavailable(RetryableError):
    """Kafka is unreachable or timed out; the batch was not acknowledged. ``code`` is the
    client's error code when it gave one; ``retry_call`` says the same call may be
    repeated at once, within the caller's deadline (librdkafka's ``retriable`` flag on a
    transactional call, or a consumer group's coordinator still settling)."""

    waits_on = "kafka"

    def __init__(self, message: str, *, code: int | None = None, retry_call: bool = False) -> None:
        self.code = code
        self.retry_call = retry_call
        super().__init__(message)


class AclRefused(BrokerUnavailable):
    """The broker refuses the relay's principal an operation on a topic or the cluster
    (an ACL: ``TOPIC_AUTHORIZATION_FAILED``, ``CLUSTER_AUTHORIZATION_FAILED``). Retried
    until the ACL is granted; never an event's poison, never a halt (#48)."""

    waits_on = "kafka_acl"


class TransactionAborted(BrokerUnavailable):
    """The transaction had to be aborted (a record failed, or the broker said so)."""


class ConsumerHiccup(BrokerUnavailable):
    """A consumer error the client recovers from by itself (it reconnects): readers log
    it and read on, within their own deadline."""


class SchemaRegistryUnavailable(RetryableError):
    """The schema registry did not answer, or answered with a server error: the events
    wait for it (never poison)."""

    waits_on = "schema_registry"


class SchemaRegistryFault(SchemaRegistryUnavailable):
    """The schema registry answered, but wrongly: an id that is no schema id or names
    another schema, a conflict its own compatibility test does not confirm. Its fault,
    never the events' nor the operator's: waited for like an outage, the answer never
    kept."""


class TopicMissing(RetryableError):
    """A topic to publish to does not exist, and ``create_topics`` is false: the
    operator creates it. The part waits and goes on once it exists (#48); only a
    ``dead-letter`` subscriber takes a row that chose such a topic as poison, so that one
    row cannot hold back the rest (``PoisonRecordError.wait``)."""

    waits_on = "topic"

    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"waiting for topic {topic!r}: {reason}")


class TopicBudgetFull(RetryableError):
    """A row's topic is allowed, but ``max_created_topics`` topics were created for rows
    already (or the schema has no record of them yet, before migration 0017): the
    relay's configuration, never the row's fault. The part waits and retries (issue
    #47), alerted through ``outbox_relay_part_waiting{service="topic_budget"}``."""

    waits_on = "topic_budget"

    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        super().__init__(f"topic {topic!r} waits: {reason}")


class EncodingError(RelayError):
    """An outbox row cannot be turned into a Kafka record (a poison event)."""


class PoisonRecordError(EncodingError):
    """The broker (or the client, before sending) rejected one record for what it is."""

    def __init__(
        self,
        record: KafkaRecord,
        reason: str,
        *,
        ambiguous: bool = False,
        wait: RetryableError | None = None,
    ) -> None:
        self.record = record
        self.reason = reason
        # True when several records failed together (the broker rejects whole produce
        # batches): ``record`` is only the first of them, maybe not the culprit.
        self.ambiguous = ambiguous
        # Set when the refusal heals by itself (a topic the row chose does not exist
        # yet): a 'halt' part waits on it rather than halt; 'dead-letter' takes the row.
        self.wait = wait
        super().__init__(f"broker rejected a record for topic {record.topic!r}: {reason}")


class SubscriberError(RelayError):
    """A subscriber is unknown, misconfigured or already exists."""


class CheckpointConflict(RetryableError):
    """The checkpoint changed underneath us (reset, pause, or another owner): reload it."""


class GroupRefused(BrokerUnavailable):
    """The broker refuses a consumer group to the relay's principal (no ``Read`` on it: an
    ACL), so the Kafka-side checkpoint cannot be read; retried until the ACL is fixed."""

    waits_on = "kafka_acl"

    def __init__(self, context: str, reason: str, *, code: int | None = None) -> None:
        super().__init__(
            f"{context}: the broker refuses this consumer group ({reason}); grant the relay's "
            "principal Read on it (deploy/README.md, ACLs)",
            code=code,
        )


class ClaimLost(RelayError):
    """This relay no longer owns the subscriber part (its session expired, or another
    relay took over). It must stop publishing that part; nothing is retried."""


class ProducerFenced(BrokerUnavailable):
    """The broker fenced this part's transactional producer, or the producer failed
    fatally. A newer owner may exist, or the broker aborted a transaction that outlived
    ``transaction.timeout.ms`` (it bumps the epoch, which fences us too). So the worker
    starts over: it reloads its claim (a peer's claim stops it) and recovers with a new
    producer."""


class TransactionalIdRefused(ProducerFenced):
    """The broker refuses this transactional id to the relay's principal (no ``Write`` on
    it: an ACL). The producer is unusable, as if fenced, and the part retries until the
    ACL is fixed; nobody without that right can commit under the id either."""

    waits_on = "kafka_acl"

    def __init__(self, transactional_id: str, reason: str, *, code: int | None = None) -> None:
        self.transactional_id = transactional_id
        super().__init__(
            f"{transactional_id}: the broker refuses this transactional id ({reason}); grant "
            "the relay's principal Write and Describe on it (deploy/README.md, ACLs)",
            code=code,
        )


class SinkUnreadable(RelayError):
    """A consumer's sink (``verify --through``) cannot be read: its folder is missing, a
    file its commit log lists is gone or not Parquet, or the log itself is damaged."""
