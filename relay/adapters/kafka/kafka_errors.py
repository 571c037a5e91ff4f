"""The one place that reads a Kafka client error and decides what it means.

confluent-kafka reports failures as a ``KafkaException`` wrapping a ``KafkaError`` (a
code plus librdkafka's ``fatal``, ``retriable`` and ``txn_requires_abort`` flags), or as
a bare ``KafkaError`` in delivery reports and consumed messages. :func:`classify` turns
either into the relay's error tree; the same code can mean different things depending on
what the client was doing (:class:`Stage`): ``TOPIC_EXCEPTION`` is a poison record when
producing, a refused topic name when creating it. Callers raise the result ``from`` the
client's exception. See "Errors" in docs/design.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal, TypedDict, Unpack, overload

from confluent_kafka import KafkaError, KafkaException

from relay.core.model import KafkaRecord
from relay.errors import (
    AclRefused,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    ConsumerHiccup,
    GroupRefused,
    PoisonRecordError,
    ProducerFenced,
    RelayError,
    TopicRefused,
    TransactionAborted,
    TransactionalIdRefused,
)


class Stage(enum.Enum):
    """What the client was doing when it failed."""

    REQUEST = "request"  # metadata, committed offsets, ...: retryable whatever the code
    PRODUCE = "produce"  # Producer.produce refused a record before sending it
    DELIVERY = "delivery"  # a delivery report, or flush: the acknowledgements
    TRANSACTION = "transaction"  # a transactional producer call
    CREATE_TOPIC = "create topic"  # AdminClient.create_topics, for one topic
    READ = "read"  # a consumed message carried an error
    GROUP_OFFSETS = "group offsets"  # reading a consumer group's committed offsets
    CONFIGURE = "configure"  # the client refused its configuration or a request locally


# Delivery errors that are the record's fault, not the broker's: a poison event.
RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)
FENCED = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)
# Topic-creation errors about the name itself ('.', '..', one colliding with an existing
# topic on '.' against '_', a creation policy): the routed row's fault, so its poison.
# Other refusals (authorization, replication factor) are the relay's configuration.
TOPIC_NAME_ERRORS = frozenset({KafkaError.TOPIC_EXCEPTION, KafkaError.POLICY_VIOLATION})
UNSUPPORTED = frozenset({KafkaError.UNSUPPORTED_VERSION, KafkaError._UNSUPPORTED_FEATURE})
# The broker refuses the relay's principal a right on a topic or the cluster (an ACL):
# retried until it is granted (issue #48: a refused creation used to halt the part).
AUTHORIZATION = frozenset(
    {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
)
CREATION_FATAL = frozenset(
    {
        KafkaError.INVALID_CONFIG,
        KafkaError.INVALID_PARTITIONS,
        KafkaError.INVALID_REQUEST,
        *UNSUPPORTED,
    }
)
# Reading a topic: no right to it, or its records are gone (retention passed the offset).
READ_FATAL = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.OFFSET_OUT_OF_RANGE,
    }
)
# A group's coordinator is being found or loaded, or a commit is still pending: all pass.
GROUP_TRANSIENT = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.UNSTABLE_OFFSET_COMMIT,
        KafkaError._TIMED_OUT,
    }
)

# A transactional call's coordinator went away (its broker died, or handed the
# transaction state log's partition over): see coordinator_moved.
COORDINATOR_MOVED = frozenset(
    {KafkaError._TRANSPORT, KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE}
)


# The stages at which every client error is a failure (typing: classify returns no None).
_AlwaysAnError = Literal[
    Stage.REQUEST,
    Stage.PRODUCE,
    Stage.DELIVERY,
    Stage.TRANSACTION,
    Stage.GROUP_OFFSETS,
    Stage.CONFIGURE,
]


class Details(TypedDict, total=False):
    """What :func:`classify` needs besides the error, at the one stage each is read."""

    record: KafkaRecord | None  # Stage.PRODUCE: the record the client refused
    config: Mapping[str, Any] | None  # Stage.TRANSACTION: quoted when the broker refuses it


@overload
def classify(
    failure: KafkaException | KafkaError,
    context: str,
    stage: Literal[Stage.CREATE_TOPIC, Stage.READ],
    **details: Unpack[Details],
) -> RelayError | None: ...


@overload
def classify(
    failure: KafkaException | KafkaError,
    context: str,
    stage: _AlwaysAnError = Stage.REQUEST,
    **details: Unpack[Details],
) -> RelayError: ...


def classify(
    failure: KafkaException | KafkaError,
    context: str,
    stage: Stage = Stage.REQUEST,
    **details: Unpack[Details],
) -> RelayError | None:
    """The relay error for a client ``failure`` during ``stage``; None when it is no
    failure there (a topic that already exists, the end of a partition).

    ``context`` says what was attempted (it starts the message; for
    :attr:`Stage.CREATE_TOPIC` it is the topic, for :attr:`Stage.TRANSACTION` the
    transactional id). :attr:`Stage.PRODUCE` needs the ``record``; ``config`` is the
    client's configuration, quoted when the broker refuses a setting of it.
    """
    if stage is Stage.CONFIGURE:
        # The client checks its configuration locally: whatever the code, the settings
        # are wrong, and no retry can help.
        return ConfigError(f"{context}: {failure}")
    error = failure.args[0] if isinstance(failure, KafkaException) and failure.args else failure
    if not isinstance(error, KafkaError):
        return _without_code(stage, context, str(failure))
    if stage is Stage.PRODUCE:
        return _produce(error, context, details.get("record"))
    if stage is Stage.DELIVERY:
        return _delivery(error, context)
    if stage is Stage.TRANSACTION:
        return _transaction(error, context, details.get("config") or {})
    if stage is Stage.CREATE_TOPIC:
        return _create_topic(error, context)
    if stage is Stage.READ:
        return _read(error, context)
    if stage is Stage.GROUP_OFFSETS and error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return GroupRefused(context, error.str(), code=error.code())
    retry_call = stage is Stage.GROUP_OFFSETS and error.code() in GROUP_TRANSIENT
    return BrokerUnavailable(f"{context}: {error.str()}", code=error.code(), retry_call=retry_call)


def retry_now(failure: RelayError) -> bool:
    """Whether the failed call may be repeated at once (see ``BrokerUnavailable``)."""
    return isinstance(failure, BrokerUnavailable) and failure.retry_call


def coordinator_moved(failure: RelayError) -> bool:
    """Whether a failed transactional call met a coordinator that went away. The same call
    made again on the same producer is where librdkafka may block past any timeout
    (issue 5511); a new producer finds the new coordinator at once."""
    return isinstance(failure, BrokerUnavailable) and failure.code in COORDINATOR_MOVED


def rejects_record(error: KafkaError) -> bool:
    """Whether a failed delivery is the record's own fault (a poison record)."""
    return error.code() in RECORD_ERRORS


def _without_code(stage: Stage, context: str, text: str) -> RelayError:
    """An exception without a ``KafkaError``: nothing to read but its text. Producing,
    that is fatal as any other refusal of the record; otherwise retry later."""
    if stage is Stage.PRODUCE:
        return BrokerError(f"{context}: {text}")
    if stage is Stage.CREATE_TOPIC:
        return BrokerUnavailable(f"cannot create topic {context!r}: {text}")
    if stage is Stage.TRANSACTION:
        return BrokerUnavailable(f"transaction failed: {text}")
    return BrokerUnavailable(f"{context}: {text}")


def _fenced(error: KafkaError) -> bool:
    return error.fatal() or error.code() in FENCED


def _produce(error: KafkaError, context: str, record: KafkaRecord | None) -> RelayError:
    if record is not None and rejects_record(error):
        return PoisonRecordError(record, error.str())
    return BrokerError(f"{context}: {error.str()}", code=error.code())


def _delivery(error: KafkaError, context: str) -> RelayError:
    if error.code() in AUTHORIZATION:
        right = (
            "Write and Describe on the topic"
            if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
            else "IdempotentWrite on the cluster"
        )
        return AclRefused(
            f"{context}: {error.str()}; grant the relay's principal {right} "
            "(deploy/README.md, ACLs): the part publishes once it may",
            code=error.code(),
        )
    if _fenced(error):
        return ProducerFenced(
            f"producer fenced or failed fatally: {error.str()}", code=error.code()
        )
    return BrokerUnavailable(f"{context}: {error.str()}", code=error.code())


def _transaction(error: KafkaError, transactional_id: str, config: Mapping[str, Any]) -> RelayError:
    code = error.code()
    if code == KafkaError.INVALID_TRANSACTION_TIMEOUT:
        return ConfigError(
            f"the broker refuses transaction.timeout.ms="
            f"{config.get('transaction.timeout.ms')} ({error.str()}): lower "
            "session_timeout (the relay uses session_timeout, at least 10 s and at most "
            "15 min) or raise the brokers' transaction.max.timeout.ms"
        )
    if code == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
        return TransactionalIdRefused(transactional_id, error.str(), code=code)
    if code in AUTHORIZATION:
        # A topic of the transaction refused (adding its partitions, or the checkpoint's
        # offsets): no retry on this producer helps; the part waits for the ACL (#48).
        return AclRefused(
            f"{transactional_id}: the broker refuses the relay's principal a topic of this "
            f"transaction ({error.str()}); grant it Write and Describe on the output topics "
            "and Read on the checkpoint topic (deploy/README.md, ACLs): the part publishes "
            "once it may",
            code=code,
        )
    if _fenced(error):
        return ProducerFenced(
            f"{transactional_id}: producer fenced (a newer owner, or the "
            f"broker aborted a transaction past its timeout): {error.str()}",
            code=code,
        )
    if code in UNSUPPORTED:
        return BrokerError(
            f"the broker does not support transactions ({error.str()}); "
            "set delivery = 'idempotent' (at-least-once across restarts)",
            code=code,
        )
    if error.txn_requires_abort():
        return TransactionAborted(f"transaction aborted: {error.str()}", code=code)
    return BrokerUnavailable(
        f"transaction failed: {error.str()}", code=code, retry_call=error.retriable()
    )


def _create_topic(error: KafkaError, topic: str) -> RelayError | None:
    """Fatal only when the broker says the relay's own setup is wrong (a topic config or
    partition count it refuses): anything else, a broker going away mid-request or an
    ACL not granted yet included, passes, so the part retries instead of halting."""
    code = error.code()
    if code == KafkaError.TOPIC_ALREADY_EXISTS:
        return None
    if code in TOPIC_NAME_ERRORS:
        return TopicRefused(topic, error.str(), code=code)
    if code in AUTHORIZATION:
        return AclRefused(
            f"cannot create topic {topic!r}: {error.str()}; grant the relay's principal "
            "Create on it (deploy/README.md, ACLs), or create it yourself: the part "
            "publishes once it exists",
            code=code,
        )
    if code in CREATION_FATAL:
        return BrokerError(f"cannot create topic {topic!r}: {error.str()}", code=code)
    hint = ""
    if code == KafkaError.INVALID_REPLICATION_FACTOR:
        # Also what a starting broker answers while it is still fenced.
        hint = " (if this persists, check topic_replication_factor against the brokers)"
    return BrokerUnavailable(f"cannot create topic {topic!r}: {error.str()}{hint}", code=code)


def _read(error: KafkaError, context: str) -> RelayError | None:
    code = error.code()
    if code == KafkaError._PARTITION_EOF:
        return None
    if error.fatal() or code in READ_FATAL:
        return BrokerUnavailable(f"{context}: {error.str()}", code=code)
    # Transport hiccups: librdkafka reconnects; the reader's deadline bounds it.
    return ConsumerHiccup(f"{context}: {error.str()}", code=code)
