"""Issue #32: the avro-registry value format as the worker, the settings and start-up
use it, over a registry client double (the real registry: tests/acceptance/
test_avro_registry.py). A registry that cannot be reached stalls the part (retried,
never poison); a schema it refuses halts the part with its reason (never poison)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, cast

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from relay import Outbox
from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.adapters.registry.confluent_wire import unframe
from relay.adapters.registry.registry_format import RegistryValueEncoder
from relay.core.model import PartId
from relay.core.ports import RelaySession
from relay.core.redact import redact
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.core.settings import load_settings
from relay.core.subscribers import KeyFormat, PoisonPolicy, SubjectStrategy, Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.engine.encoding import RecordEncoder
from relay.engine.worker import PartWorker
from relay.errors import ConfigError, EncodingError, PayloadValidationError, SubscriberError
from relay.ops.subscribers import Setup, check
from tests.support import wait_until
from tests.unit.engine.test_worker_logic import OWNER, claimed, event, run_until_halted

SCHEMAS = SchemaFolder(
    [
        AvroSchema.from_json(
            {
                "type": "record",
                "name": "OrderPlaced",
                "namespace": "shop",
                "fields": [{"name": "n", "type": "long"}],
            }
        )
    ]
)
REGISTRY = Subscriber(
    "s", topic="t", value_format=ValueFormat.AVRO_REGISTRY, on_poison=PoisonPolicy.DEAD_LETTER
)


class Registry:
    """Answers ``register_schema`` with id 7 once ``failures`` calls have raised, and
    ``get_schema(7)`` with the schema last registered (as the relay checks an id)."""

    def __init__(self, failures: list[Exception | int]) -> None:
        self.failures = failures
        self.subjects: list[str] = []
        self.observe: Callable[[], object] = lambda: None
        self.observed: list[object] = []  # observe() at each call
        self.held: Schema | None = None

    def register_schema(self, subject: str, schema: Schema) -> int:
        self.subjects.append(subject)
        self.observed.append(self.observe())
        self.held = schema
        if self.failures:
            failure = self.failures.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return failure  # a wrong answer
        return 7

    def get_schema(self, schema_id: int) -> Schema:
        assert schema_id == 7 and self.held is not None
        return self.held

    def lookup_schema(self, subject: str, schema: Schema) -> Any:
        raise SchemaRegistryError(404, 40403, "Schema not found")

    def test_compatibility_all_versions(self, subject: str, schema: Schema) -> bool:
        return False  # a 409 is a refusal

    def get_compatibility(self, subject: str | None = None) -> str:
        if subject is not None:
            raise SchemaRegistryError(404, 40408, "no level of its own")
        return "BACKWARD"


def part_worker(store: InMemoryStore, kafka: InMemoryPublisher, registry: Registry) -> PartWorker:
    values = RegistryValueEncoder(SCHEMAS, cast(SchemaRegistryClient, registry))
    return PartWorker(
        PartId("s", 0),
        session=RelaySession(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: kafka,
        encoder=RecordEncoder(SCHEMAS, schema_registry=values),
        batch_size=100,
        batch_max_bytes=2**62,
        poll_interval=0.05,
    )


def test_an_unreachable_registry_is_retried_and_nothing_is_poison(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.registry.registry_format")
    caplog.set_level(logging.INFO, logger="relay.engine.worker")
    store = claimed(REGISTRY)
    for n in range(3):
        store.append(event(n))
    kafka = InMemoryPublisher()
    down = [ConnectionError("connection refused"), ConnectionError("connection refused")]
    registry = Registry(down)
    w = part_worker(store, kafka, registry)
    registry.observe = lambda: w.stats.waiting_on
    w.start()
    try:
        last = store.events[-1].key
        wait_until(lambda: store.get_part("s", 0).checkpoint == last, what="publication")
    finally:
        w.stop()
        w.join(10)
    assert (w.stats.poisoned, w.stats.dead_lettered, w.stats.errors) == (0, 0, 2)
    values = [r.value for r in kafka.published()]
    assert [unframe(v)[0] for v in values] == [7, 7, 7]
    assert registry.subjects == ["t-value"] * 3  # 2 failures, then cached: 1 success
    # The part says what it waits for while it retries (/metrics, /readyz), not after.
    assert registry.observed == [None, "schema_registry", "schema_registry"]
    assert w.stats.waiting_on is None
    # One warning for the outage, not one per retry; one line when it is over.
    events = [(r.levelno, getattr(r, "event", None)) for r in caplog.records]
    assert [e for e in events if e[1] in ("registry.unreachable", "registry.reachable")] == [
        (logging.WARNING, "registry.unreachable"),
        (logging.INFO, "registry.reachable"),
    ]
    # And the part: one warning for its first retry, the others counted (issue #49).
    assert [e for e in events if e[1] in ("part_retrying", "part_waited")] == [
        (logging.WARNING, "part_retrying"),
        (logging.INFO, "part_waited"),
    ]
    [waited] = [r for r in caplog.records if getattr(r, "event", None) == "part_waited"]
    assert "after 2 attempts that failed" in waited.getMessage()
    [reachable] = [r for r in caplog.records if getattr(r, "event", None) == "registry.reachable"]
    assert "2 requests failed" in reachable.getMessage()


def test_a_part_logs_a_new_kind_of_registry_failure_and_counts_the_same_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="relay.engine.worker")
    store = claimed(REGISTRY)
    store.append(event(1))
    kafka = InMemoryPublisher()
    registry = Registry([ConnectionError("connection refused"), -7, -7])
    w = part_worker(store, kafka, registry)
    w.start()
    try:
        wait_until(lambda: store.get_part("s", 0).checkpoint == store.events[-1].key)
    finally:
        w.stop()
        w.join(10)
    retries = [r for r in caplog.records if getattr(r, "event", None) == "part_retrying"]
    assert [r.levelno for r in retries] == [logging.WARNING, logging.WARNING, logging.DEBUG]
    assert "answered -7" in retries[1].getMessage()
    assert (w.stats.poisoned, w.stats.dead_lettered) == (0, 0)
    assert [unframe(r.value)[0] for r in kafka.published()] == [7]


def test_a_schema_the_registry_refuses_halts_the_part_with_its_reason() -> None:
    store = claimed(REGISTRY)
    store.append(event(1))
    kafka = InMemoryPublisher()
    refusal = SchemaRegistryError(409, 409, "Incompatible schema: field n changed type")
    w = run_until_halted(part_worker(store, kafka, Registry([refusal])), store)
    halted = store.get_part("s", 0).halted_error or ""
    assert halted.startswith("configuration error")
    assert "field n changed type" in halted and "'t-value'" in halted
    assert "(compatibility BACKWARD)" in halted  # the level the registry applies
    assert kafka.published() == []
    assert (w.stats.poisoned, w.stats.dead_lettered) == (0, 0)
    assert w.stats.state is WorkerState.HALTED


def test_subject_strategies() -> None:
    assert SubjectStrategy.TOPIC.subject("t", "shop.A") == "t-value"
    assert SubjectStrategy.RECORD.subject("t", "shop.A") == "shop.A"
    assert SubjectStrategy.TOPIC_RECORD.subject("t", "shop.A") == "t-shop.A"
    defined = Subscriber.from_dict({"name": "s", "subject_strategy": "topic-record"})
    assert defined.subject_strategy is SubjectStrategy.TOPIC_RECORD
    assert Subscriber.from_dict(defined.as_dict()) == defined


def test_registry_settings_are_masked_and_the_password_may_come_from_a_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret-registry-pw\n")
    monkeypatch.setenv("RELAY_SCHEMA_REGISTRY_PASSWORD_FILE", str(secret))
    settings = load_settings(
        schema_registry_url="https://user:urlpassword@registry:8081",
        schema_registry_user="relay",
    )
    assert settings.schema_registry_password is not None
    assert settings.schema_registry_password.get_secret_value() == "s3cret-registry-pw"
    shown = repr(settings)
    assert "s3cret-registry-pw" not in shown and "urlpassword" not in shown
    assert "registry:8081" in shown
    # The client's errors may quote it: masked wherever the relay shows text.
    assert "s3cret-registry-pw" not in redact("401 for relay:s3cret-registry-pw")


@pytest.mark.parametrize(
    "given",
    [
        {"schema_registry_url": "http://registry:8081", "schema_registry_user": "relay"},
        {"schema_registry_url": "http://registry:8081", "schema_registry_password": "s3cret-pw"},
        {"schema_registry_url": "http://relay:s3cret-pw@registry:8081"},
        {"schema_registry_url": "https://a:8081,http://b:8081", "schema_registry_user": "relay"},
    ],
)
def test_credentials_over_plain_http_are_refused_unless_allowed(given: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(**given)
    message = str(refused.value)
    assert "schema_registry_allow_http_credentials" in message and "https://" in message
    assert "s3cret-pw" not in message
    assert load_settings(**given, schema_registry_allow_http_credentials=True)


def test_plain_http_without_credentials_and_https_with_them_are_accepted() -> None:
    assert load_settings(schema_registry_url="http://registry:8081")
    assert load_settings(schema_registry_url="https://registry:8081", schema_registry_user="u")


def test_avro_registry_without_a_registry_url_or_schemas_is_refused() -> None:
    """As `subscribers add` and `run` check a definition (relay/ops/subscribers.py)."""

    def refusals(setup: Setup) -> list[str]:
        return [str(r.error) for r in check(setup, [REGISTRY]).refusals]

    [refused] = refusals(Setup(load_settings(), SCHEMAS))
    assert "subscriber 's' publishes avro-registry" in refused
    assert "schema_registry_url" in refused
    [refused] = refusals(Setup(load_settings(schema_registry_url="http://r:8081"), None))
    assert "schemas_dir" in refused
    assert refusals(Setup(load_settings(schema_registry_url="http://r:8081"), SCHEMAS)) == []


def test_avro_registry_keys_are_avro_strings_under_the_topics_key_subject() -> None:
    registry = Registry([])
    values = RegistryValueEncoder(SCHEMAS, cast(SchemaRegistryClient, registry))
    encoder = RecordEncoder(SCHEMAS, schema_registry=values)
    keyed = dataclasses.replace(REGISTRY, key_format=KeyFormat.AVRO_REGISTRY)

    first = encoder.encode(event(1), keyed)
    encoder.encode(event(2), keyed)

    assert unframe(first.key or b"") == (7, b"\x04k1")  # zig-zag length 2, then "k1"
    assert unframe(first.value)[0] == 7
    assert registry.subjects == ["t-value", "t-key"]  # each once: the ids are cached
    assert encoder.encode(event(1), REGISTRY).key == b"k1"  # the default: text


def test_avro_registry_keys_need_the_avro_registry_value_format() -> None:
    with pytest.raises(SubscriberError, match="key format avro-registry needs value format"):
        Subscriber("s", value_format=ValueFormat.JSON, key_format=KeyFormat.AVRO_REGISTRY)
    with pytest.raises(ConfigError, match=r"subscribers\.0\.key_format"):
        load_settings(subscribers=[{"name": "s", "key_format": "avro-registry"}])
    defined = Subscriber.from_dict({**REGISTRY.as_dict(), "key_format": "avro-registry"})
    assert defined.key_format is KeyFormat.AVRO_REGISTRY
    assert Subscriber.from_dict(defined.as_dict()) == defined


def test_append_refuses_what_an_avro_registry_subscriber_could_not_publish() -> None:
    """The Outbox and the avro-registry encoder read the same writer schema (the schemas
    folder's, which the relay registers): a payload the relay could only poison is
    refused at append, before the database sees it, naming every field."""
    outbox = Outbox(SCHEMAS)
    encoder = RecordEncoder(
        SCHEMAS,
        schema_registry=RegistryValueEncoder(SCHEMAS, cast(SchemaRegistryClient, Registry([]))),
    )
    bad = event(1)._replace(payload={"n": "one"})
    with pytest.raises(EncodingError):
        encoder.encode(bad, REGISTRY)
    with pytest.raises(PayloadValidationError, match=r"shop\.OrderPlaced\.n"):
        outbox.append(
            cast(Any, None),  # refused before any statement runs
            aggregate_type="order",
            aggregate_id="1",
            event_type="OrderPlaced",
            payload=bad.payload,
        )
