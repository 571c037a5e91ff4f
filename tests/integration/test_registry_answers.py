"""The avro-registry encoder against a real schema registry (Apicurio) when it races or
answers wrongly (issues #47 and #49): parts registering a subject's first schema at the
same moment all get its id (Apicurio answers some of them 409 "already exists"); a
refusal names the level the registry applies; an id that names another schema is
never used (a stand-in in front of the real registry answers it)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, ClassVar

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from relay.adapters.registry.registry_compat import check_subscriber, schema_text
from relay.adapters.registry.registry_format import RegistryValueEncoder
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.core.subscribers import Subscriber, ValueFormat
from relay.errors import RetryableError, SchemaIncompatible, SchemaRegistryFault
from tests.plugins.registry import StandinRegistry

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

ORDER = AvroSchema.from_json(
    {
        "type": "record",
        "name": "Order",
        "namespace": "shop",
        "fields": [{"name": "id", "type": "long"}],
    }
)
TEXT_ID = AvroSchema.from_json(
    {
        "type": "record",
        "name": "Order",
        "namespace": "shop",
        "fields": [{"name": "id", "type": "string"}],
    }
)
PARTS = 4


class ConflictCounting(SchemaRegistryClient):
    """The stock client, counting the conflicts (409) the registry answers."""

    conflicts: ClassVar[Counter[str]] = Counter()

    def register_schema(self, *args: Any, **kwargs: Any) -> int:
        try:
            return int(super().register_schema(*args, **kwargs))
        except SchemaRegistryError as exc:
            ConflictCounting.conflicts[str(exc.http_status_code)] += 1
            raise


def _first_publish(url: str, topic: str) -> list[Any]:
    """PARTS encoders (as many parts) encode their first event at the same moment, each
    retrying as its part would; what each ended with (a value, or the error it halted on)."""
    barrier = threading.Barrier(PARTS)
    ended: list[Any] = [None] * PARTS

    def part(i: int) -> None:
        encoder = RegistryValueEncoder(SchemaFolder([ORDER]), ConflictCounting({"url": url}))
        barrier.wait()
        for _ in range(20):
            try:
                ended[i] = encoder.encode(topic, "Order", {"id": i})
                return
            except RetryableError:
                continue  # the worker retries with backoff
            except SchemaIncompatible as exc:  # the worker halts the part
                ended[i] = exc
                return

    threads = [threading.Thread(target=part, args=(i,)) for i in range(PARTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ended


def test_parts_registering_a_subjects_first_schema_at_once_all_get_its_id(
    schema_registry: str, topic_prefix: str
) -> None:
    """Issue #49: on a fresh deployment, parts registering their first schema together
    got 409 "already exists" from Apicurio and halted as a configuration error."""
    ConflictCounting.conflicts.clear()
    rounds = 0
    while ConflictCounting.conflicts["409"] < 3 and rounds < 40:  # until the race was seen
        topic = f"{topic_prefix}race{rounds}"
        ended = _first_publish(schema_registry, topic)
        rounds += 1
        halted = [e for e in ended if not isinstance(e, bytes)]
        assert halted == [], f"round {rounds}: {halted}"
        [registered] = {v[1:5] for v in ended}  # one id for all
        latest = SchemaRegistryClient({"url": schema_registry}).get_latest_version(f"{topic}-value")
        assert int.from_bytes(registered, "big") == latest.schema_id
    assert ConflictCounting.conflicts["409"] >= 1, "the registry never raced: nothing was shown"


@pytest.fixture
def global_backward(schema_registry: str) -> Any:
    """The registry's global compatibility level BACKWARD, for one test (it is shared)."""
    client = SchemaRegistryClient({"url": schema_registry})
    before = client.get_compatibility()
    client.set_compatibility(level="BACKWARD")
    yield
    client.set_compatibility(level=before)


@pytest.mark.usefixtures("global_backward")
def test_a_refusal_names_the_global_level_when_the_subject_has_none(
    schema_registry: str, topic_prefix: str
) -> None:
    """Apicurio answers NONE for a subject without a level of its own, while its global
    BACKWARD refuses the schema: the refusals (at start-up and at publish) name BACKWARD."""
    topic = f"{topic_prefix}orders"
    client = SchemaRegistryClient({"url": schema_registry})
    client.register_schema(f"{topic}-value", Schema(schema_text(ORDER), "AVRO"))
    subscriber = Subscriber("s", topic=topic, value_format=ValueFormat.AVRO_REGISTRY)

    with pytest.raises(SchemaIncompatible) as at_start:
        check_subscriber(client, SchemaFolder([TEXT_ID]), subscriber)
    with pytest.raises(SchemaIncompatible) as at_publish:
        RegistryValueEncoder(SchemaFolder([TEXT_ID]), client).encode(topic, "Order", {"id": "x"})

    assert "(compatibility BACKWARD, versions [1])" in str(at_start.value)
    assert "(compatibility BACKWARD)" in str(at_publish.value)
    assert "fields/0/type" in str(at_publish.value)  # the registry's reason


def test_an_id_that_names_another_schema_is_never_used(
    standin_registry: StandinRegistry, schema_registry: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}orders"
    real = SchemaRegistryClient({"url": schema_registry})
    other = real.register_schema(f"{topic_prefix}other-value", Schema(schema_text(TEXT_ID), "AVRO"))
    standin_registry.script("POST", r"/subjects/.*/versions", (200, {"id": other}))
    encoder = RegistryValueEncoder(
        SchemaFolder([ORDER]), SchemaRegistryClient({"url": standin_registry.url})
    )

    for _ in range(2):  # asked again: the wrong id is kept nowhere
        with pytest.raises(SchemaRegistryFault, match=f"id {other} for shop.Order"):
            encoder.encode(topic, "Order", {"id": 1})
    assert standin_registry.count("POST", r"/subjects/.*/versions") == 2
    standin_registry.heal()
    value = encoder.encode(topic, "Order", {"id": 1})

    assert int.from_bytes(value[1:5], "big") == real.get_latest_version(f"{topic}-value").schema_id
    context = SerializationContext(topic, MessageField.VALUE)
    assert AvroDeserializer(real)(value, context) == {"id": 1}
