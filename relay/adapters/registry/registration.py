"""Registering a schema under a subject, with the registry's answer checked before any
record is framed with it (issues #47 and #49).

The id goes into every record's header, where consumers look the writer schema up by
it: a wrong id makes every record unreadable, or read with another schema, and nothing
downstream can tell. So a newly learned id is checked once, before it is used:

- it must be a registry id (an integer, 0 to 2**31 - 1): an answer of ``-7`` or
  ``"7"`` is the registry's fault, not the events';
- the schema the registry holds under it (``GET /schemas/ids/{id}``, past the client's
  cache, which holds what the relay sent) must have the local schema's parsing
  canonical form (compared by CRC-64-AVRO fingerprint), whatever the registry did to
  its formatting, docs or defaults.

Either failure is :class:`SchemaRegistryFault`: the part waits and retries as for an
outage (alerted the same way), and the id is kept nowhere, the client's cache included.

A 409 is not a refusal by itself: Confluent answers it for an incompatible schema, and
Apicurio also when two requests create a subject at the same moment (the storage race
of a fresh deployment, where parts register their first schema together). So the
registration looks the schema up first (another part may have registered it: its id,
checked as above), then asks the registry's compatibility test: only its "not
compatible" makes :class:`SchemaIncompatible`, naming the level the registry applies
and its reason. Anything else is retried.
"""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from relay.adapters.registry.confluent_wire import MAX_ID, is_registry_id
from relay.adapters.registry.registry_compat import applied_level, compatibility
from relay.adapters.registry.registry_errors import CONFLICT, registry_call, registry_text
from relay.errors import SchemaIncompatible, SchemaRegistryFault

__all__ = ["Registrar"]

# Ids checked at most (then forgotten and checked again): rows choose routed topics.
_MAX_VERIFIED = 4096


class Registrar:
    """Registers schemas through ``client``; each id the registry answers is checked
    once per process (:meth:`register`)."""

    def __init__(self, client: SchemaRegistryClient) -> None:
        self.client = client
        self._verified: dict[int, str] = {}  # id -> the fingerprint it was checked with

    def register(self, subject: str, text: str, what: str) -> int:
        """The id of the Avro schema ``text`` (``what`` says which) under ``subject``,
        registered if new, checked against ``text``."""
        candidate = Schema(text, "AVRO")
        answer = registry_call(subject, lambda: self._post(subject, candidate), what)
        try:
            if isinstance(answer, SchemaRegistryError):
                answer = self._after_conflict(subject, candidate, what, answer)
            return self._checked(subject, text, what, answer)
        except SchemaRegistryFault:
            _forget(self.client)  # the client caches what the registry answered
            raise

    def _post(self, subject: str, candidate: Schema) -> Any:
        """The registry's answer to the registration; a 409 is returned, not raised."""
        try:
            return self.client.register_schema(subject, candidate)
        except SchemaRegistryError as exc:
            if exc.http_status_code == CONFLICT:
                return exc
            raise

    def _after_conflict(
        self, subject: str, candidate: Schema, what: str, conflict: SchemaRegistryError
    ) -> Any:
        """The id after a 409: the schema's, if the subject holds it now; else a refusal
        if the registry's compatibility test confirms one; else a fault (retried)."""
        found = registry_call(
            subject, lambda: self.client.lookup_schema(subject, candidate), what, missing_ok=True
        )
        if found is not None:  # registered meanwhile, by another part or relay
            return found.schema_id
        compatible, reason = compatibility(self.client, subject, candidate)
        if not compatible:
            level = applied_level(self.client, subject, refused=True)
            raise SchemaIncompatible(
                f"the schema registry refused {what} under {subject!r} "
                f"(compatibility {level}): {reason or registry_text(conflict)}"
            )
        raise SchemaRegistryFault(
            f"the schema registry answered a conflict to {what} under {subject!r} "
            f"({registry_text(conflict)}), but does not hold it and its compatibility "
            "test accepts it: not a refusal, retried"
        )

    def _checked(self, subject: str, text: str, what: str, schema_id: Any) -> int:
        """``schema_id``, once shown to be the registry's id of ``text``."""
        if type(schema_id) is not int or not is_registry_id(schema_id):  # bool is an int
            raise SchemaRegistryFault(
                f"the schema registry answered {registry_text(repr(schema_id), 40)} as the id "
                f"of {what} under {subject!r}: not a schema id (0..{MAX_ID}), not used"
            )
        local = _fingerprint(text)
        if self._verified.get(schema_id) == local:
            return schema_id
        held = registry_call(
            subject, lambda: _schema_by_id(self.client, schema_id), what, missing_ok=True
        )
        theirs = None if held is None else _fingerprint_or_none(held)
        if theirs != local:
            holds = "no schema" if held is None else f"a schema of fingerprint {theirs}"
            raise SchemaRegistryFault(
                f"the schema registry answered id {schema_id} for {what} under {subject!r}, "
                f"but holds {holds} under that id (the local schema's fingerprint is "
                f"{local}): not used"
            )
        if len(self._verified) >= _MAX_VERIFIED:
            self._verified.clear()
        self._verified[schema_id] = local
        return schema_id


def _schema_by_id(client: SchemaRegistryClient, schema_id: int) -> str | None:
    """The text the registry holds under ``schema_id``, asked of the registry itself:
    the client's ``get_schema`` answers from its cache, where the registration put the
    schema the relay sent, whatever id the registry gave it."""
    rest = getattr(client, "_rest_client", None)
    if rest is None:  # another client release: its public call, cache emptied first
        _forget(client)
        return client.get_schema(schema_id).schema_str
    answer = rest.get(f"schemas/ids/{schema_id}")
    text = answer.get("schema") if isinstance(answer, dict) else None
    return text if isinstance(text, str) else None


def _forget(client: SchemaRegistryClient) -> None:
    """Empty the client's caches, so that its next call asks the registry."""
    clear = getattr(client, "clear_caches", None)
    if clear is not None:
        clear()


def _fingerprint(text: str) -> str:
    """The CRC-64-AVRO fingerprint (hex) of the Avro schema ``text``'s parsing canonical
    form."""
    parsed = parse_schema(json.loads(text), _write_hint=False)
    return str(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


def _fingerprint_or_none(text: str) -> str | None:
    """As :func:`_fingerprint`; None for a text that is no Avro schema."""
    try:
        return _fingerprint(text)
    except Exception:  # fastavro and json raise several unrelated types
        return None
