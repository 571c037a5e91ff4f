"""The single error hierarchy of outbox-relay.

Every error the package raises derives from :class:`RelayError`. Errors that a
caller (or the relay's own loop) may retry after a pause derive from
:class:`RetryableError`; everything else is fatal for the operation at hand.
Driver errors are wrapped with ``raise ... from exc`` so the cause stays visible.
"""

from __future__ import annotations


class RelayError(Exception):
    """Base class of every outbox-relay error."""


class RetryableError(RelayError):
    """A transient fault: the same operation may succeed later."""


class ConfigError(RelayError):
    """Invalid settings; the message names the offending key."""


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
    deadlock): the transaction is rolled back; retry the whole application transaction."""


class DatabaseError(RelayError):
    """A Postgres error that retrying will not fix (permissions, missing schema, ...)."""


class DatabaseUnavailable(RetryableError):
    """Postgres is unreachable or the connection broke."""


class NotMigratedError(DatabaseError):
    """The outbox tables are missing or older than this code: run ``outbox-relay migrate``."""


class BrokerError(RelayError):
    """A Kafka error that retrying will not fix."""


class BrokerUnavailable(RetryableError):
    """Kafka is unreachable or timed out; the batch was not acknowledged."""


class EncodingError(RelayError):
    """An outbox row cannot be turned into a Kafka record (a poison event)."""


class SubscriberError(RelayError):
    """A subscriber is unknown, misconfigured or already exists."""


class CheckpointConflict(RetryableError):
    """The checkpoint changed underneath us (reset, pause, or another owner): reload it."""


class ClaimLost(RelayError):
    """This relay no longer owns the subscriber part (its session expired, or another
    relay took over). It must stop publishing that part; nothing is retried."""


class ProducerFenced(BrokerUnavailable):
    """The broker fenced this part's transactional producer, or the producer failed
    fatally. A newer owner may exist, or the broker aborted a transaction that outlived
    ``transaction.timeout.ms`` (it bumps the epoch, which fences us too). So the worker
    starts over: it reloads its claim (a peer's claim stops it) and recovers with a new
    producer."""
