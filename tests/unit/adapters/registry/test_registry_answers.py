"""What the relay makes of a schema registry's answers (issues #47 and #49), over a
registry client double (a real registry and a scripted stand-in for it:
tests/integration/test_registry_answers.py, tests/acceptance/test_registry_faults.py).

A registry's fault is never the events' nor the operator's: an id that is no id or
names another schema is retried and never kept; a 409 is a refusal only when the
registry's compatibility test says so, and the refusal names the level the registry
applies; its text is capped and escaped before it is logged or stored."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from confluent_kafka.schema_registry import RegisteredSchema, Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from relay.adapters.registry.registration import Registrar
from relay.adapters.registry.registry_errors import MAX_TEXT, registry_call, registry_text
from relay.errors import (
    SchemaIncompatible,
    SchemaRegistryFault,
    SchemaRegistryUnavailable,
)

ORDER = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "namespace": "shop",
        "fields": [{"name": "n", "type": "long"}],
    }
)
# The same schema as the registry may give it back: other spacing, a doc, a default.
ORDER_AS_STORED = json.dumps(
    {
        "namespace": "shop",
        "name": "Order",
        "type": "record",
        "doc": "kept by the registry",
        "fields": [{"type": "long", "name": "n"}],
    },
    indent=2,
)
OTHER = json.dumps({"type": "record", "name": "Other", "fields": [{"name": "x", "type": "string"}]})
HOSTILE = "\x1b[2J\x1b[31mboom" + "x" * 200_000 + "\n2026-01-01 00:00:00 ERROR relay: forged"


class Registry:
    """Answers as scripted: ``ids`` in turn to registrations (an exception is raised),
    ``held`` for ``GET /schemas/ids/{id}``; counts what it was asked."""

    def __init__(self, *ids: object, held: dict[int, str] | None = None) -> None:
        self.ids = list(ids)
        self.held = held if held is not None else {}
        self.found: RegisteredSchema | None = None  # lookup_schema's answer (None: 404)
        self.compatible: object = False
        self.levels: dict[str | None, str] = {None: "BACKWARD"}
        self.asked: list[str] = []
        self.cleared = 0

    def register_schema(self, subject: str, schema: Schema) -> Any:
        self.asked.append(f"register {subject}")
        answer = self.ids.pop(0) if len(self.ids) > 1 else self.ids[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def get_schema(self, schema_id: int) -> Schema:
        self.asked.append(f"get {schema_id}")
        if schema_id not in self.held:
            raise SchemaRegistryError(404, 40403, "Schema not found")
        return Schema(self.held[schema_id], "AVRO")

    def lookup_schema(self, subject: str, schema: Schema) -> RegisteredSchema:
        self.asked.append(f"lookup {subject}")
        if self.found is None:
            raise SchemaRegistryError(404, 40403, "Schema not found")
        return self.found

    def test_compatibility_all_versions(self, subject: str, schema: Schema) -> object:
        self.asked.append(f"compatibility {subject}")
        return self.compatible

    def get_compatibility(self, subject: str | None = None) -> str:
        if subject not in self.levels:
            raise SchemaRegistryError(404, 40408, "Subject does not have compatibility level")
        return self.levels[subject]

    def clear_caches(self) -> None:
        self.cleared += 1


def registrar(registry: Registry) -> Registrar:
    return Registrar(cast(SchemaRegistryClient, registry))


# -- ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [-7, 2**31, "7", 7.0, True, None])
def test_an_id_that_is_no_registry_id_is_the_registrys_fault_and_never_kept(
    answer: object,
) -> None:
    registry = Registry(answer, held={7: ORDER})
    for _ in range(2):  # asked again each time: nothing kept
        with pytest.raises(SchemaRegistryFault, match="not a schema id") as fault:
            registrar(registry).register("t-value", ORDER, "shop.Order")
        assert isinstance(fault.value, SchemaRegistryUnavailable)  # waited for, not poison
    assert registry.asked == ["register t-value"] * 2
    assert registry.cleared == 2  # nor in the client's cache


def test_an_id_that_names_another_schema_is_refused_until_the_registry_is_right() -> None:
    registry = Registry(3, held={3: OTHER, 7: ORDER_AS_STORED})
    registering = registrar(registry)

    with pytest.raises(SchemaRegistryFault, match=r"id 3 for shop\.Order .* holds a schema of"):
        registering.register("t-value", ORDER, "shop.Order")
    assert registry.cleared >= 1  # the client's cache holds nothing of it
    registry.ids = [7]  # healed
    assert registering.register("t-value", ORDER, "shop.Order") == 7
    # Checked once per id: the same id under another subject is not fetched again.
    assert registering.register("u-value", ORDER, "shop.Order") == 7
    assert registry.asked == ["register t-value", "get 3", "register t-value", "get 7",
                              "register u-value"]  # fmt: skip


def test_an_id_the_registry_does_not_hold_is_its_fault() -> None:
    with pytest.raises(SchemaRegistryFault, match="holds no schema under that id"):
        registrar(Registry(9)).register("t-value", ORDER, "shop.Order")


# -- 409 ------------------------------------------------------------------------------

ALREADY = SchemaRegistryError(
    409, 0, "An artifact with ID 't-value' in group 'null' already exists."
)


def test_a_conflict_for_a_schema_registered_meanwhile_takes_its_id() -> None:
    """Apicurio's storage race: two parts register a subject's first schema at once."""
    registry = Registry(ALREADY, held={5: ORDER})
    registry.found = RegisteredSchema(
        schema_id=5, guid=None, schema=Schema(ORDER, "AVRO"), subject="t-value", version=1
    )

    assert registrar(registry).register("t-value", ORDER, "shop.Order") == 5
    assert registry.asked == ["register t-value", "lookup t-value", "get 5"]


def test_a_conflict_the_compatibility_test_does_not_confirm_is_retried() -> None:
    registry = Registry(ALREADY)
    registry.compatible = True
    with pytest.raises(SchemaRegistryFault, match="not a refusal, retried"):
        registrar(registry).register("t-value", ORDER, "shop.Order")
    registry.compatible = "false"  # no verdict either: not a refusal
    with pytest.raises(SchemaRegistryFault, match="gave no verdict"):
        registrar(registry).register("t-value", ORDER, "shop.Order")


def test_a_confirmed_refusal_names_the_level_the_registry_applies() -> None:
    """Apicurio answers NONE for a subject without a level of its own while its global
    BACKWARD refuses the schema: the refusal names BACKWARD."""
    registry = Registry(SchemaRegistryError(409, 409, "Incompatible: field n changed type"))
    registry.levels = {"t-value": "NONE", None: "BACKWARD"}

    with pytest.raises(SchemaIncompatible) as refused:
        registrar(registry).register("t-value", ORDER, "shop.Order")
    message = str(refused.value)
    assert "(compatibility BACKWARD)" in message and "field n changed type" in message
    registry.levels = {None: "FULL"}  # no level of its own: 404, the global one
    with pytest.raises(SchemaIncompatible, match=r"\(compatibility FULL\)"):
        registrar(registry).register("t-value", ORDER, "shop.Order")


# -- the registry's text ------------------------------------------------------------------


def test_the_registrys_text_is_capped_and_escaped() -> None:
    shown = registry_text(HOSTILE)
    assert "\x1b" not in shown and "\n" not in shown
    assert shown.startswith("\\x1b[2J\\x1b[31mboom")
    assert len(shown) < MAX_TEXT + 100 and shown.endswith(f"[cut: {len(HOSTILE)} characters]")
    assert registry_text("a\u2028b\x9bc\r\td") == "a\\u2028b\\x9bc\\r\\td"


@pytest.mark.parametrize(
    ("raised", "mapped"),
    [
        (SchemaRegistryError(500, 50001, HOSTILE), SchemaRegistryUnavailable),
        (SchemaRegistryError(409, 409, HOSTILE), SchemaRegistryFault),
        (SchemaRegistryError(422, 42201, HOSTILE), SchemaIncompatible),
        (ConnectionError(HOSTILE), SchemaRegistryUnavailable),
    ],
)
def test_every_error_of_the_registry_is_mapped_with_its_text_made_safe(
    raised: Exception, mapped: type[Exception]
) -> None:
    def call() -> None:
        raise raised

    with pytest.raises(mapped) as caught:
        registry_call("t-value", call, "shop.Order")
    assert type(caught.value) is mapped
    message = str(caught.value)
    assert "\x1b" not in message and "\n" not in message and len(message) < 2 * MAX_TEXT
