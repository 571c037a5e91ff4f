"""The value formats are registered in one place (relay/core/formats/): each is one
module and one line, and the rest of the relay asks for a format's traits instead of
naming it (no servers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay.core.formats import ValueFormat, default_format, format_of, local_formats

RELAY = Path(__file__).resolve().parents[3] / "relay"
# Three at most: the registration, and room for the few rules that pick one format
# by name (the default format's) should they move out of it.
MOST_NAMING = 3


def modules_naming_a_member(root: Path) -> list[str]:
    """The modules under ``root`` that name a member of ValueFormat (``ValueFormat.JSON``)."""
    members = "|".join(member.name for member in ValueFormat)
    named = re.compile(rf"\bValueFormat\.({members})\b")
    return sorted(
        str(path.relative_to(root.parent))
        for path in root.rglob("*.py")
        if named.search(path.read_text())
    )


def test_at_most_three_modules_name_a_format_member() -> None:
    naming = modules_naming_a_member(RELAY)
    assert len(naming) <= MOST_NAMING, naming
    assert "relay/core/formats/__init__.py" in naming  # the scan finds the registration


@pytest.mark.parametrize("value_format", list(ValueFormat))
def test_every_format_is_registered_with_a_writer(value_format: ValueFormat) -> None:
    registered = format_of(value_format)
    assert (registered.values is None) != (registered.records is None)


def test_the_traits_say_what_the_formats_did_by_name() -> None:
    """What the relay asked of each format by name before it was registered."""
    assert local_formats() == {ValueFormat.JSON, ValueFormat.AVRO}
    assert [f for f in ValueFormat if format_of(f).registry] == [ValueFormat.AVRO_REGISTRY]
    assert [f for f in ValueFormat if format_of(f).envelope] == [ValueFormat.JSON]
    assert [f for f in ValueFormat if format_of(f).fixed_routing] == [ValueFormat.DEBEZIUM]
    assert [f for f in ValueFormat if not format_of(f).relay_headers] == [ValueFormat.DEBEZIUM]
    assert [f for f in ValueFormat if format_of(f).passed_through] == [ValueFormat.JSON]
    assert not any(format_of(f).raw_payloads for f in ValueFormat)  # only a twin takes them
    assert default_format(has_schemas=True) is ValueFormat.AVRO
    assert default_format(has_schemas=False) is ValueFormat.JSON
