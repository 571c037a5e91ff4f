"""The value formats, registered: each is one module of this package holding its
writer, its preconditions and its traits (a :class:`~relay.core.formats.base.Format`),
and one line below. The rest of the relay asks :func:`format_of` for a subscriber's
format and its traits, and names no format (tests/unit/core/test_formats.py checks that).

Adding a format: write its module (``FORMAT = Format(...)``), then add its member to
:class:`ValueFormat` and its line to ``_REGISTERED`` (docs/design.md, "Value formats")."""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from relay.core.formats import avro, avro_registry, debezium, json_text, json_values
from relay.core.formats.base import Format


class ValueFormat(StrEnum):
    """A subscriber's value format, as stored and as the command line takes it."""

    AVRO = "avro"
    JSON = "json"
    DEBEZIUM = "debezium"  # as Debezium's Outbox Event Router
    AVRO_REGISTRY = "avro-registry"  # Avro in the Confluent wire format


_REGISTERED: dict[ValueFormat, Format] = {
    ValueFormat.AVRO: avro.FORMAT,
    # Passed through (json_text) when the subscriber's routing reads no payload field.
    ValueFormat.JSON: dataclasses.replace(json_values.FORMAT, passed_through=json_text.FORMAT),
    ValueFormat.DEBEZIUM: debezium.FORMAT,
    ValueFormat.AVRO_REGISTRY: avro_registry.FORMAT,
}

# A subscriber that names no format: Avro when writer schemas are loaded, else JSON
# (a Subscriber built without one, as a stored row before formats were chosen: Avro).
WITH_SCHEMAS = ValueFormat.AVRO
WITHOUT_SCHEMAS = ValueFormat.JSON


def format_of(value_format: ValueFormat) -> Format:
    return _REGISTERED[value_format]


def publishing_format(value_format: ValueFormat, *, reads_payload: bool) -> Format:
    """The format a subscriber of ``value_format`` publishes: its pass-through twin when
    it has one and the subscriber's routing reads nothing of the payload (issue #53)."""
    spec = _REGISTERED[value_format]
    if spec.passed_through is not None and not reads_payload:
        return spec.passed_through
    return spec


def default_format(*, has_schemas: bool) -> ValueFormat:
    """The format of a subscriber that names none."""
    return WITH_SCHEMAS if has_schemas else WITHOUT_SCHEMAS


def local_formats() -> frozenset[ValueFormat]:
    """The formats encoded without asking a registry."""
    return frozenset(f for f, spec in _REGISTERED.items() if spec.local)
