"""The ``json`` value format passed through (issue #53): a json subscriber whose routing
reads nothing of the payload publishes the payload's JSON text as Postgres returns it
(jsonb's text output), never loaded into Python nor written again. The fetch leaves the
payload as those bytes (``Selection.raw_payloads``), but for the few rows today's path
would change or refuse (numbers of 304 digits or more, deep nesting): those it loads, and
their values are written as ``json`` writes them, so what was poison stays poison
(docs/design.md, "Value formats": the trade-offs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.core.formats.base import Encoders, Format, Subscribed, ValueWriter
from relay.core.formats.json_values import json_value

if TYPE_CHECKING:
    from relay.core.model import OutboxEvent


def passed_through(event: OutboxEvent, topic: str) -> bytes:
    """The fetched JSON text as it is; a payload the fetch loaded, as ``json`` writes it."""
    payload = event.payload
    if type(payload) is bytes:
        return payload
    return json_value(event, topic)


def _values(encoders: Encoders, subscriber: Subscribed) -> ValueWriter:
    return passed_through


FORMAT = Format(values=_values, local=True, raw_payloads=True)
