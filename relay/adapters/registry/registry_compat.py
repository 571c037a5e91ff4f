"""Checks an avro-registry subscriber's local writer schemas against the schema
registry's compatibility rules before anything is published (issue #32): at
``subscribers add`` and at relay start-up. Nothing is registered here; the relay
registers a schema when it first publishes it (relay/adapters/registry/registry_format.py).

Which (subject, schema) pairs are checked:

- the event types in scope are the subscriber's ``event_types`` filter, or every writer
  schema of the folder;
- the topic must be known without a row: a fixed topic, a template of ``{event_type}``
  only, or ``{aggregate_type}`` with an ``aggregate_types`` filter. Otherwise the
  ``topic`` and ``topic-record`` subjects are found at the first publish, and checked
  then (a refusal halts the part);
- with the ``topic`` strategy and no ``event_types`` filter, only the folder's schema of
  the record the subject already holds is checked: which other event types reach the
  topic is the rows' business, and testing every schema of the folder against one
  subject would refuse subscribers that are fine.

With ``key_format`` avro-registry, the key schema (``"string"``) is checked under the
``<topic>-key`` subject of each topic known. A refusal names the subject, its
compatibility level, its versions, the local schema (full name, file, fingerprint) and
the registry's reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from relay.adapters.registry.registry_errors import registry_call, registry_text
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.core.subscribers import KeyFormat, SubjectStrategy, Subscriber
from relay.errors import SchemaIncompatible, SchemaRegistryFault, UnknownEventTypeError

__all__ = [
    "KEY_SCHEMA",
    "CompatibilityReport",
    "applied_level",
    "check_subscriber",
    "compatibility",
    "schema_text",
]

# The schema of avro-registry keys (the aggregate_id): an Avro string.
KEY_SCHEMA = '"string"'


def schema_text(schema: AvroSchema) -> str:
    """The schema as the relay registers it: the parsed form keeps defaults and docs
    (the parsing canonical form drops them, and compatibility rules need defaults)."""
    return json.dumps(schema.parsed, separators=(",", ":"))


@dataclass(frozen=True)
class CompatibilityReport:
    """What a check found: one line per (subject, schema) checked, and what it could
    not check before a row names the topic."""

    checked: list[str]
    unchecked: list[str]


def check_subscriber(
    client: SchemaRegistryClient, schemas: SchemaFolder, subscriber: Subscriber
) -> CompatibilityReport:
    """Check ``subscriber``'s schemas; :class:`SchemaIncompatible` lists every refusal
    (and every event type of its filter without a writer schema),
    :class:`SchemaRegistryUnavailable` when the registry cannot answer."""
    in_scope, missing = _event_schemas(schemas, subscriber)
    refusals = [
        f"event type {name!r} of the subscriber's filter has no writer schema in the schemas folder"
        for name in missing
    ]
    checked: list[str] = []
    per_row: list[str] = []
    key_topics: set[str] = set()
    for schema in in_scope:
        topics = _topics(subscriber, schema)
        key_topics.update(topics or ())
        subjects = _subjects(subscriber, schema, topics)
        if subjects is None:
            per_row.append(schema.full_name)
            continue
        for subject in subjects:
            if _elsewhere(client, subscriber, subject, schema):
                continue
            verdict = _check(client, subject, schema_text(schema), _local(schema))
            (checked if verdict.ok else refusals).append(verdict.text)
    if subscriber.key_format is KeyFormat.AVRO_REGISTRY:
        for topic in sorted(key_topics):
            verdict = _check(client, f"{topic}-key", KEY_SCHEMA, f"the key schema {KEY_SCHEMA}")
            (checked if verdict.ok else refusals).append(verdict.text)
    unchecked = (
        [f"{', '.join(per_row)}: the topic of {subscriber.topic!r} is chosen per row"]
        if per_row
        else []
    )
    if refusals:
        raise SchemaIncompatible(
            f"subscriber {subscriber.name!r}: the schema registry's rules refuse its "
            "schemas:\n  " + "\n  ".join(refusals)
        )
    return CompatibilityReport(checked, unchecked)


def _event_schemas(
    schemas: SchemaFolder, subscriber: Subscriber
) -> tuple[list[AvroSchema], list[str]]:
    if subscriber.event_types is None:
        return [schemas.writer_for(name) for name in schemas.event_types], []
    found: dict[str, AvroSchema] = {}
    missing = []
    for name in sorted(subscriber.event_types):
        try:
            schema = schemas.writer_for(name)
        except UnknownEventTypeError:
            missing.append(name)
            continue
        found[schema.full_name] = schema
    return list(found.values()), missing


def _topics(subscriber: Subscriber, schema: AvroSchema) -> list[str] | None:
    """The topics events of ``schema``'s type go to, when known without a row."""
    routed: list[str | None]
    if subscriber.fixed_topic is not None:
        routed = [subscriber.fixed_topic]
    elif "{aggregate_type}" not in subscriber.topic:
        routed = [subscriber.route("", schema.full_name)]
    elif subscriber.aggregate_types is not None:
        routed = [subscriber.route(a, schema.full_name) for a in sorted(subscriber.aggregate_types)]
    else:
        return None
    return sorted({t for t in routed if t is not None})


def _subjects(
    subscriber: Subscriber, schema: AvroSchema, topics: list[str] | None
) -> list[str] | None:
    """The subjects ``schema`` goes to, when known without a row."""
    strategy = subscriber.subject_strategy
    if strategy is SubjectStrategy.RECORD:
        return [strategy.subject("", schema.full_name)]
    if topics is None:
        return None
    return sorted({strategy.subject(t, schema.full_name) for t in topics})


def _elsewhere(
    client: SchemaRegistryClient, subscriber: Subscriber, subject: str, schema: AvroSchema
) -> bool:
    """Whether a topic subject holds another record, with no event-type filter saying
    that ``schema`` goes there (see the module's docstring)."""
    if subscriber.subject_strategy is not SubjectStrategy.TOPIC or subscriber.event_types:
        return False
    return _latest_record(client, subject) not in (None, schema.full_name)


def _latest_record(client: SchemaRegistryClient, subject: str) -> str | None:
    """The full name of the record the subject's latest version holds (None: new)."""
    latest = _ask(subject, lambda: client.get_latest_version(subject))
    if latest is None:
        return None
    try:
        document = json.loads(latest.schema.schema_str or "")
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    name = str(document.get("name", ""))
    namespace = document.get("namespace")
    return name if "." in name or not namespace else f"{namespace}.{name}"


@dataclass(frozen=True)
class _Verdict:
    ok: bool
    text: str


def _local(schema: AvroSchema) -> str:
    return f"{schema.full_name} ({schema.path or 'schema'}, fingerprint {schema.fingerprint.hex()})"


def _check(client: SchemaRegistryClient, subject: str, text: str, local: str) -> _Verdict:
    """The registry's verdict on the schema ``text`` (``local`` says which) under
    ``subject``. What the registry answered is shown through :func:`registry_text`."""
    candidate = Schema(text, "AVRO")
    registered = _ask(subject, lambda: client.lookup_schema(subject, candidate))
    if registered is not None:
        version, schema_id = _shown(registered.version), _shown(registered.schema_id)
        return _Verdict(True, f"{subject}: {local} is version {version} (id {schema_id})")
    versions = _ask(subject, lambda: client.get_versions(subject)) or []
    if not versions:
        return _Verdict(True, f"{subject}: new subject, {local} is registered at first publish")
    compatible, reason = compatibility(client, subject, candidate)
    level = applied_level(client, subject, refused=not compatible)
    shown = _shown(versions)
    if compatible:
        return _Verdict(True, f"{subject}: {local} is compatible with versions {shown} ({level})")
    where = f"subject {subject!r} (compatibility {level}, versions {shown})"
    return _Verdict(False, f"{where} refuses {local}: {reason or '(no reason given)'}")


def _shown(value: object) -> str:
    """A short value of the registry's answer (a version, an id, a list of versions)."""
    return registry_text(value, 200)


def applied_level(client: SchemaRegistryClient, subject: str, *, refused: bool = False) -> str:
    """The compatibility level the registry applies to ``subject``: the subject's own,
    else the global one. ``refused``: the registry has just refused a schema there, so
    a subject level of NONE (which refuses nothing) cannot be the one it applied:
    Apicurio answers NONE for a subject without a rule of its own, not 404. Otherwise
    such a NONE is shown with the global level beside it."""
    level = _ask(subject, lambda: _subject_level(client, subject))
    if level is not None and str(level).upper() != "NONE":
        return registry_text(level, 40)
    applied = registry_text(_ask(subject, client.get_compatibility) or "unknown", 40)
    if level is None or refused or applied.upper() == "NONE":
        return applied
    return f"NONE, or the global {applied} if the subject has no level of its own"


def _subject_level(client: SchemaRegistryClient, subject: str) -> Any:
    """The subject's level, or the global one where the registry falls back to it
    itself (``defaultToGlobal``: Confluent, Karapace)."""
    rest = getattr(client, "_rest_client", None)
    if rest is None:  # another client release: the subject's own level, or 404
        return client.get_compatibility(subject)
    answer = rest.get(f"config/{_quoted(subject)}", {"defaultToGlobal": "true"})
    return answer.get("compatibilityLevel") if isinstance(answer, dict) else None


def compatibility(
    client: SchemaRegistryClient, subject: str, candidate: Schema
) -> tuple[bool, str]:
    """The registry's verdict on ``candidate`` against the subject's versions (as its
    compatibility level says: the transitive levels test them all), with its reason
    (made safe to show; empty if none); :class:`SchemaRegistryFault` when it gives no
    verdict.

    The client's ``test_compatibility_all_versions`` returns the verdict and drops the
    reason; the same request goes through the client's own REST transport to keep it
    (Confluent and Karapace answer ``messages``, Apicurio ``reason``)."""
    rest = getattr(client, "_rest_client", None)
    if rest is None:  # another client release: the verdict without the reason
        verdict = _ask(subject, lambda: client.test_compatibility_all_versions(subject, candidate))
        return _verdict(subject, {"is_compatible": verdict}), ""
    path = f"compatibility/subjects/{_quoted(subject)}/versions?verbose=true"
    answer: Any = _ask(subject, lambda: rest.post(path, body=candidate.to_dict()))
    if answer is None:
        return True, ""  # the subject went away meanwhile: nothing to be compatible with
    reasons = answer.get("messages") or answer.get("reason") if isinstance(answer, dict) else None
    if isinstance(reasons, list):
        reasons = "; ".join(str(r) for r in reasons)
    return _verdict(subject, answer), registry_text(reasons or "")


def _verdict(subject: str, answer: Any) -> bool:
    """``is_compatible`` of the registry's answer, if it is a boolean."""
    verdict = answer.get("is_compatible") if isinstance(answer, dict) else None
    if not isinstance(verdict, bool):
        raise SchemaRegistryFault(
            f"the schema registry's compatibility test for {subject!r} gave no verdict: "
            f"{registry_text(answer, 200)}"
        )
    return verdict


def _quoted(subject: str) -> str:
    return quote(subject, safe="")


def _ask(subject: str, call: Callable[[], Any]) -> Any:
    """``call()``; None when the registry answers 404 (no such subject or schema)."""
    return registry_call(subject, call, "a check", missing_ok=True)
