"""One error tree (#16 item 3): every error class lives in relay.errors under RelayError,
and each driver's errors are classified at one place, as each call site decided before.
No servers: driver errors are built by hand."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException
from psycopg import errors as pg_errors

import relay
import relay.adapters.kafka.topics
import relay.errors
from relay.adapters.kafka.checkpoint_groups import CheckpointGroups
from relay.adapters.kafka.kafka import IdempotentPublisher, TopicCreator, TransactionalPublisher
from relay.adapters.kafka.kafka_errors import Stage, classify, rejects_record, retry_now
from relay.adapters.postgres.db import StreamRef, wrap_errors
from relay.core.model import KafkaRecord
from relay.errors import (
    AclRefused,
    BrokerError,
    BrokerUnavailable,
    ConcurrencyError,
    ConfigError,
    ConsumerHiccup,
    DatabaseError,
    DatabaseUnavailable,
    GroupRefused,
    NotMigratedError,
    PoisonRecordError,
    PrivilegeMissing,
    ProducerFenced,
    RelayError,
    RetryableError,
    StaleStreamVersion,
    StreamVersionAhead,
    TopicRefused,
    TransactionAborted,
    TransactionalIdRefused,
    UndefinedFunctionError,
)

RECORD = KafkaRecord("orders", b"k", b"v", [("id", b"1")])
RELAY_DIR = Path(relay.__file__).parent


def _modules(package: Any) -> list[Any]:
    found = pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    return [importlib.import_module(m.name) for m in found if not m.name.endswith("__main__")]


# The tooling packages keep their own errors (#34 item 1), still under RelayError: the
# relay proper never raises them.
TOOLING_ERRORS = {
    "relay.localstack.process.LocalServerError",
    "relay.artifacts.maven.ArtifactFetchError",
}


def test_every_exception_class_of_relay_is_defined_in_relay_errors_under_relay_error() -> None:
    defined = {
        f"{cls.__module__}.{cls.__qualname__}": cls
        for module in _modules(relay)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__.startswith("relay.")
    }
    strays = sorted(
        name
        for name in defined
        if not name.startswith("relay.errors.") and name not in TOOLING_ERRORS
    )
    assert strays == []
    assert {name for name in TOOLING_ERRORS if issubclass(defined[name], RelayError)} == (
        TOOLING_ERRORS
    )
    outside = [
        name
        for name, cls in inspect.getmembers(relay.errors, inspect.isclass)
        if issubclass(cls, BaseException) and not issubclass(cls, RelayError)
    ]
    assert outside == []


def test_every_exception_class_of_the_spark_jobs_derives_from_relay_error() -> None:
    pytest.importorskip("pyspark")
    import spark_jobs

    classes = [
        cls
        for module in _modules(spark_jobs)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__.startswith("spark_jobs.")
    ]
    assert classes, "the spark jobs define errors of their own"
    assert [c.__name__ for c in classes if not issubclass(c, RelayError)] == []


# -- Kafka ---------------------------------------------------------------------------


def kafka(code: int, *, fatal: bool = False, retriable: bool = False, abort: bool = False) -> Any:
    error = KafkaError(code, "the broker says no", fatal, retriable, abort)
    return KafkaException(error)


# Each call site's decision before the classifier existed (relay/adapters/kafka/kafka.py, verify.py,
# dev.py, broker_watch.py, spark_jobs/kafka_sink.py), one row per code or flag.
PRODUCE = [
    (KafkaError.MSG_SIZE_TOO_LARGE, {}, PoisonRecordError),
    (KafkaError.INVALID_RECORD, {}, PoisonRecordError),
    (KafkaError.INVALID_MSG, {}, PoisonRecordError),
    (KafkaError.INVALID_MSG_SIZE, {}, PoisonRecordError),
    (KafkaError.TOPIC_EXCEPTION, {}, PoisonRecordError),
    (KafkaError.RECORD_LIST_TOO_LARGE, {}, PoisonRecordError),
    (KafkaError._UNKNOWN_TOPIC, {}, BrokerError),
    (KafkaError._FENCED, {}, BrokerError),
    (KafkaError._TRANSPORT, {"retriable": True}, BrokerError),
]
DELIVERY = [
    (KafkaError._FENCED, {}, ProducerFenced),
    (KafkaError.PRODUCER_FENCED, {}, ProducerFenced),
    (KafkaError.INVALID_PRODUCER_EPOCH, {}, ProducerFenced),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, {}, ProducerFenced),
    (KafkaError._MSG_TIMED_OUT, {"fatal": True}, ProducerFenced),
    (KafkaError._MSG_TIMED_OUT, {}, BrokerUnavailable),
    (KafkaError._TRANSPORT, {}, BrokerUnavailable),
    (KafkaError.NOT_ENOUGH_REPLICAS, {"retriable": True}, BrokerUnavailable),
    # Issue #48: an ACL's refusal waits for the grant, named as such.
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, {}, AclRefused),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, {}, AclRefused),
]
TRANSACTION = [
    (KafkaError.INVALID_TRANSACTION_TIMEOUT, {}, ConfigError),
    (KafkaError.PRODUCER_FENCED, {"abort": True}, ProducerFenced),
    (KafkaError._FENCED, {}, ProducerFenced),
    (KafkaError.INVALID_PRODUCER_EPOCH, {}, ProducerFenced),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, {}, TransactionalIdRefused),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, {"fatal": True}, TransactionalIdRefused),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, {"abort": True}, AclRefused),
    (KafkaError._TIMED_OUT, {"fatal": True}, ProducerFenced),
    (KafkaError.UNSUPPORTED_VERSION, {}, BrokerError),
    (KafkaError._UNSUPPORTED_FEATURE, {"abort": True}, BrokerError),
    (KafkaError.INVALID_TXN_STATE, {"abort": True, "retriable": True}, TransactionAborted),
    (KafkaError.CONCURRENT_TRANSACTIONS, {"retriable": True}, BrokerUnavailable),
    (KafkaError._TIMED_OUT, {}, BrokerUnavailable),
]
CREATE_TOPIC = [
    (KafkaError.TOPIC_EXCEPTION, {}, TopicRefused),
    (KafkaError.POLICY_VIOLATION, {}, TopicRefused),
    (KafkaError.TOPIC_ALREADY_EXISTS, {}, None),
    # Issue #48: a refused creation used to halt the part; it waits for the ACL.
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, {}, AclRefused),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, {}, AclRefused),
    (KafkaError.INVALID_CONFIG, {}, BrokerError),
    (KafkaError.INVALID_PARTITIONS, {}, BrokerError),
    (KafkaError.INVALID_REQUEST, {}, BrokerError),
    (KafkaError.UNSUPPORTED_VERSION, {}, BrokerError),
    (KafkaError._UNSUPPORTED_FEATURE, {}, BrokerError),
    (KafkaError.INVALID_REPLICATION_FACTOR, {}, BrokerUnavailable),
    (KafkaError._TIMED_OUT, {}, BrokerUnavailable),
    (KafkaError.NOT_CONTROLLER, {"retriable": True}, BrokerUnavailable),
]
READ = [
    (KafkaError._PARTITION_EOF, {}, None),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, {}, BrokerUnavailable),
    (KafkaError.GROUP_AUTHORIZATION_FAILED, {}, BrokerUnavailable),
    (KafkaError.OFFSET_OUT_OF_RANGE, {}, BrokerUnavailable),
    (KafkaError._TRANSPORT, {"fatal": True}, BrokerUnavailable),
    (KafkaError._TRANSPORT, {}, ConsumerHiccup),
    (KafkaError._ALL_BROKERS_DOWN, {}, ConsumerHiccup),
]
TABLE = [
    (stage, code, flags, expected)
    for stage, rows in [
        (Stage.PRODUCE, PRODUCE),
        (Stage.DELIVERY, DELIVERY),
        (Stage.TRANSACTION, TRANSACTION),
        (Stage.CREATE_TOPIC, CREATE_TOPIC),
        (Stage.READ, READ),
    ]
    for code, flags, expected in rows
]


@pytest.mark.parametrize(
    ("stage", "code", "flags", "expected"),
    TABLE,
    ids=[f"{s.name}-{KafkaError(c).name()}-{'-'.join(f) or 'plain'}" for s, c, f, _ in TABLE],
)
def test_each_kafka_error_code_maps_as_its_call_site_decided(
    stage: Stage, code: int, flags: dict[str, bool], expected: type[RelayError] | None
) -> None:
    failure = classify(kafka(code, **flags), "orders", stage, record=RECORD)
    if expected is None:
        assert failure is None
        return
    assert type(failure) is expected
    assert "the broker says no" in str(failure)
    assert getattr(failure, "code", code) == code


def test_a_poison_record_names_the_record_and_the_brokers_reason() -> None:
    failure = classify(kafka(KafkaError.MSG_SIZE_TOO_LARGE), "x", Stage.PRODUCE, record=RECORD)
    assert isinstance(failure, PoisonRecordError)
    assert failure.record is RECORD and failure.reason == "the broker says no"
    assert rejects_record(KafkaError(KafkaError.INVALID_RECORD))
    assert not rejects_record(KafkaError(KafkaError._TRANSPORT))


def test_a_refused_topic_name_carries_the_topic() -> None:
    failure = classify(kafka(KafkaError.POLICY_VIOLATION), "bad..name", Stage.CREATE_TOPIC)
    assert isinstance(failure, TopicRefused)
    assert (failure.topic, failure.reason) == ("bad..name", "the broker says no")
    assert str(failure) == "cannot create topic 'bad..name': the broker says no"


def test_a_replication_factor_refusal_hints_at_the_setting() -> None:
    failure = classify(kafka(KafkaError.INVALID_REPLICATION_FACTOR), "t", Stage.CREATE_TOPIC)
    assert "check topic_replication_factor" in str(failure)


def test_a_client_refusing_its_configuration_is_a_config_error_whatever_the_code() -> None:
    failure = classify(kafka(KafkaError._INVALID_ARG), "kafka: invalid consumer configuration",
                       Stage.CONFIGURE)  # fmt: skip
    assert type(failure) is ConfigError
    assert str(failure).startswith("kafka: invalid consumer configuration: KafkaError{")


def test_a_refused_transaction_timeout_quotes_the_setting_and_the_fix() -> None:
    config = {"transaction.timeout.ms": 120000}
    failure = classify(
        kafka(KafkaError.INVALID_TRANSACTION_TIMEOUT), "txn", Stage.TRANSACTION, config=config
    )
    assert "transaction.timeout.ms=120000" in str(failure)
    assert "session_timeout" in str(failure) and "transaction.max.timeout.ms" in str(failure)


def test_a_fenced_transactional_producer_is_named() -> None:
    failure = classify(kafka(KafkaError.PRODUCER_FENCED), "relay.s.0", Stage.TRANSACTION)
    assert str(failure).startswith("relay.s.0: producer fenced")


def test_a_refused_checkpoint_group_asks_for_its_acl() -> None:
    code = KafkaError.GROUP_AUTHORIZATION_FAILED
    failure = classify(kafka(code), "reading group 'g'", Stage.GROUP_OFFSETS)
    assert isinstance(failure, GroupRefused) and failure.code == code
    assert str(failure).startswith("reading group 'g': the broker refuses this consumer group")
    assert "Read on it" in str(failure)


def test_a_refused_transactional_id_names_the_id_and_the_acl_not_a_newer_owner() -> None:
    """It was reported as "producer fenced (a newer owner ...)", which sent an operator
    looking for another relay rather than at the broker's ACLs."""
    code = KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    failure = classify(kafka(code), "relay.s.0.2", Stage.TRANSACTION)
    assert isinstance(failure, TransactionalIdRefused)
    assert failure.transactional_id == "relay.s.0.2"
    assert str(failure).startswith("relay.s.0.2: the broker refuses this transactional id")
    assert "Write and Describe" in str(failure) and "newer owner" not in str(failure)


@pytest.mark.parametrize(
    ("stage", "flags", "retry"),
    [
        (Stage.TRANSACTION, {"retriable": True}, True),
        (Stage.TRANSACTION, {}, False),
        (Stage.TRANSACTION, {"retriable": True, "abort": True}, False),
        (Stage.DELIVERY, {"retriable": True}, False),
    ],
)
def test_only_a_retriable_transactional_call_is_repeated_at_once(
    stage: Stage, flags: dict[str, bool], retry: bool
) -> None:
    assert (
        retry_now(classify(kafka(KafkaError.CONCURRENT_TRANSACTIONS, **flags), "t", stage)) is retry
    )


@pytest.mark.parametrize(
    ("code", "retry"),
    [
        (KafkaError.NOT_COORDINATOR, True),
        (KafkaError.COORDINATOR_NOT_AVAILABLE, True),
        (KafkaError.COORDINATOR_LOAD_IN_PROGRESS, True),
        (KafkaError.UNSTABLE_OFFSET_COMMIT, True),
        (KafkaError._TIMED_OUT, True),
        (KafkaError.GROUP_AUTHORIZATION_FAILED, False),
        (KafkaError._TRANSPORT, False),
    ],
)
def test_reading_group_offsets_retries_only_while_the_coordinator_settles(
    code: int, retry: bool
) -> None:
    failure = classify(kafka(code), "sink s: cannot read its marker", Stage.GROUP_OFFSETS)
    assert isinstance(failure, BrokerUnavailable)
    assert retry_now(failure) is retry


@pytest.mark.parametrize(
    ("stage", "expected", "message"),
    [
        (Stage.PRODUCE, BrokerError, "ctx: weird"),
        (Stage.DELIVERY, BrokerUnavailable, "ctx: weird"),
        (Stage.TRANSACTION, BrokerUnavailable, "transaction failed: weird"),
        (Stage.CREATE_TOPIC, BrokerUnavailable, "cannot create topic 'ctx': weird"),
        (Stage.REQUEST, BrokerUnavailable, "ctx: weird"),
    ],
)
def test_an_exception_without_a_kafka_error_is_judged_by_its_stage(
    stage: Stage, expected: type[RelayError], message: str
) -> None:
    failure = classify(KafkaException("weird"), "ctx", stage)
    assert type(failure) is expected
    assert str(failure) == message


def test_any_other_request_failure_is_retried_later() -> None:
    failure = classify(kafka(KafkaError.TOPIC_AUTHORIZATION_FAILED), "describing the cluster")
    assert type(failure) is BrokerUnavailable
    assert str(failure) == "describing the cluster: the broker says no"


# -- Kafka catch sites ---------------------------------------------------------------


def _raised_by_hand(path: Path) -> list[str]:
    """The ``raise SomeError(...)`` statements inside handlers of a Kafka exception."""
    found = []
    for handler in ast.walk(ast.parse(path.read_text())):
        if not isinstance(handler, ast.ExceptHandler) or handler.type is None:
            continue
        if "KafkaException" not in ast.unparse(handler.type):
            continue
        found += [
            f"{path.relative_to(RELAY_DIR.parent)}:{node.lineno}"
            for node in ast.walk(handler)
            if isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and ast.unparse(node.exc.func) != "classify"
        ]
    return found


def test_every_kafka_catch_site_raises_what_the_classifier_decided() -> None:
    """A class picked by hand where a client exception is caught is a second reading of
    Kafka's errors, and drifted from the first (#34 item 1): a handler raises what
    :func:`classify` returned, or re-raises."""
    by_hand = [site for path in sorted(RELAY_DIR.rglob("*.py")) for site in _raised_by_hand(path)]
    assert by_hand == []


class RefusingAdmin:
    def list_topics(self, timeout: float) -> None:
        raise kafka(KafkaError._TRANSPORT)


def test_listing_topics_that_fails_is_retried_later_with_the_brokers_code() -> None:
    for list_topics in (
        lambda admin: TopicCreator({})._existing(admin),
        relay.adapters.kafka.topics.list_topics,
    ):
        with pytest.raises(BrokerUnavailable) as caught:
            list_topics(RefusingAdmin())
        assert str(caught.value) == "cannot list topics: the broker says no"
        assert caught.value.code == KafkaError._TRANSPORT and not retry_now(caught.value)


BAD_CONFIG = {"bootstrap.servers": "127.0.0.1:1", "no.such.setting": "1"}


def _transactional(producer: dict[str, Any]) -> Any:
    return TransactionalPublisher(
        producer, TopicCreator({}, enabled=False), 5.0, transactional_id="t",
        transaction_timeout_s=10.0, group_prefix="g", checkpoint_topic="c",
        groups=CheckpointGroups({}),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("construct", "message"),
    [
        (lambda: IdempotentPublisher(BAD_CONFIG, TopicCreator({}), 5.0), "producer"),
        (lambda: _transactional(BAD_CONFIG), "producer"),
        (lambda: CheckpointGroups(BAD_CONFIG)._consumer("g.gen"), "consumer"),
        (lambda: relay.adapters.kafka.topics.admin_client(BAD_CONFIG), "client"),
    ],
    ids=["idempotent producer", "transactional producer", "checkpoint consumer", "admin"],
)
def test_a_client_constructed_with_settings_it_refuses_is_a_config_error(
    construct: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        construct()
    assert str(caught.value).startswith(f"kafka: invalid {message} configuration: KafkaError{{")
    assert "no.such.setting" in str(caught.value)
    assert isinstance(caught.value.__cause__, KafkaException)


# -- Postgres ------------------------------------------------------------------------


def pg(cls: type[psycopg.Error] = psycopg.errors.DatabaseError, sqlstate: str = "") -> Any:
    """A driver error as psycopg raises it for ``sqlstate`` (unknown codes, such as the
    relay's own, get a class of their own)."""
    if sqlstate:
        cls = type("PgError", (cls,), {"sqlstate": sqlstate})
    return cls("server says no (postgresql://app:hunter2@db/app)")


def classified(exc: psycopg.Error, stream: StreamRef | None = None) -> RelayError:
    with pytest.raises(RelayError) as caught, wrap_errors("hunter2", stream=stream):
        raise exc
    assert caught.value.__cause__ is exc
    return caught.value


@pytest.mark.parametrize(
    ("exc", "expected", "message"),
    [
        (pg(pg_errors.UndefinedTable), NotMigratedError, "run `outbox-relay migrate`"),
        (pg(pg_errors.UndefinedFunction), UndefinedFunctionError, "refused the operation [42883]"),
        (pg(pg_errors.InsufficientPrivilege), PrivilegeMissing, "refused the operation [42501]"),
        (pg(pg_errors.InvalidPassword), DatabaseError, "refused the operation [28P01]"),
        (pg(pg_errors.InvalidCatalogName), DatabaseError, "refused the operation [3D000]"),
        (pg(pg_errors.SerializationFailure), ConcurrencyError, "rolled the transaction back"),
        (pg(pg_errors.DeadlockDetected), ConcurrencyError, "retry the whole transaction"),
        (pg(psycopg.OperationalError), DatabaseUnavailable, "postgres is unavailable"),
        (pg(pg_errors.AdminShutdown), DatabaseUnavailable, "postgres is unavailable"),
        (pg(pg_errors.DiskFull), DatabaseUnavailable, "postgres is unavailable"),
        (pg(sqlstate="08006"), DatabaseUnavailable, "[08006], will retry"),
        (pg(sqlstate="57P01"), DatabaseUnavailable, "[57P01], will retry"),
        # The session timeouts the relay sets: a lock or statement timed out, or the
        # session ended by idle_in_transaction_session_timeout; all retried.
        (pg(pg_errors.LockNotAvailable), DatabaseUnavailable, "postgres is unavailable"),
        (pg(pg_errors.QueryCanceled), DatabaseUnavailable, "postgres is unavailable"),
        (pg(pg_errors.IdleInTransactionSessionTimeout), DatabaseUnavailable, "[25P03], will"),
        (pg(pg_errors.ReadOnlySqlTransaction), DatabaseUnavailable, "[25006], will"),
        (pg(pg_errors.UniqueViolation), DatabaseError, "postgres error [23505]"),
        (pg(sqlstate="RLY01"), DatabaseError, "postgres error [RLY01]"),
        (pg(psycopg.InterfaceError), DatabaseError, "postgres error []"),
    ],
)
def test_each_sqlstate_maps_as_before(
    exc: psycopg.Error, expected: type[RelayError], message: str
) -> None:
    error = classified(exc)
    assert type(error) is expected
    assert message in str(error)
    assert "hunter2" not in str(error)  # the secret is masked
    assert getattr(error, "sqlstate", None) == exc.sqlstate


def test_retryable_and_fatal_postgres_errors_are_told_apart_by_type() -> None:
    assert isinstance(classified(pg(pg_errors.SerializationFailure)), RetryableError)
    assert isinstance(classified(pg(sqlstate="08006")), RetryableError)
    assert not isinstance(classified(pg(pg_errors.InsufficientPrivilege)), RetryableError)


def test_a_missing_privilege_ends_a_command_but_a_running_part_waits_for_the_grant() -> None:
    """Issue #48: fatal to a command or a start (exit 1, naming `outbox-relay grant`);
    a running part waits on it, since a grant restored heals it. A row-level security
    policy's refusal (42501 too) is the row's type, not a missing grant."""
    missing = classified(pg(pg_errors.InsufficientPrivilege))
    assert isinstance(missing, DatabaseError) and not isinstance(missing, RetryableError)
    assert missing.waits_on == "postgres_privilege"
    assert "permanent until granted" in str(missing)
    assert "outbox-relay grant --relay-role" in str(missing)
    policy = pg_errors.InsufficientPrivilege('new row violates row-level security policy "x"')
    refused = classified(policy)
    assert type(refused) is DatabaseError and refused.waits_on is None
    assert "--aggregate-types" in str(refused)


def test_an_acl_refusal_waits_for_the_grant_and_names_it() -> None:
    created = classify(kafka(KafkaError.TOPIC_AUTHORIZATION_FAILED), "t", Stage.CREATE_TOPIC)
    delivered = classify(kafka(KafkaError.TOPIC_AUTHORIZATION_FAILED), "3 records", Stage.DELIVERY)
    for failure, right in ((created, "Create on it"), (delivered, "Write and Describe")):
        assert isinstance(failure, AclRefused) and failure.waits_on == "kafka_acl"
        assert right in str(failure) and "deploy/README.md, ACLs" in str(failure)
    group = classify(kafka(KafkaError.GROUP_AUTHORIZATION_FAILED), "g", Stage.GROUP_OFFSETS)
    assert isinstance(group, GroupRefused) and group.waits_on == "kafka_acl"


STREAM = StreamRef("order", "42", 3)


def test_a_unique_violation_in_a_stream_append_is_a_stale_version() -> None:
    error = classified(pg(pg_errors.UniqueViolation), STREAM)
    assert isinstance(error, StaleStreamVersion) and isinstance(error, ConcurrencyError)
    assert (error.aggregate_type, error.aggregate_id, error.expected_version) == STREAM
    assert str(error) == (
        "stream order/42: expected version 3 is stale, a concurrent append wrote the next "
        "version first"
    )


def test_the_stream_order_triggers_refusal_is_a_version_ahead_of_the_stream() -> None:
    error = classified(pg(sqlstate="RLY01"), STREAM)
    assert isinstance(error, StreamVersionAhead) and isinstance(error, ConcurrencyError)
    assert (error.aggregate_type, error.aggregate_id, error.expected_version) == STREAM
    assert error.sqlstate == "RLY01"
    assert str(error) == "stream order/42: expected version 3 is ahead of the stream"


def test_other_errors_in_a_stream_append_map_as_anywhere() -> None:
    assert type(classified(pg(pg_errors.SerializationFailure), STREAM)) is ConcurrencyError
    assert type(classified(pg(pg_errors.UndefinedTable), STREAM)) is NotMigratedError


def test_relay_errors_pass_the_wrap_point_untouched() -> None:
    with pytest.raises(ConfigError) as caught, wrap_errors():
        raise ConfigError("bad")
    assert caught.value.__cause__ is None
