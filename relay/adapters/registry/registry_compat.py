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
from confluent_kafka.schema_registry.error import SchemaRegistryError

from relay.core.redact import redact
from relay.core.schemas import AvroSchema, SchemaFolder
from relay.core.subscribers import KeyFormat, SubjectStrategy, Subscriber
from relay.errors import SchemaIncompatible, SchemaRegistryUnavailable, UnknownEventTypeError

__all__ = [
    "KEY_SCHEMA",
    "CompatibilityReport",
    "check_subscriber",
    "registry_call",
    "schema_text",
]

_NOT_FOUND = 404
# Statuses that say "this schema, under this subject, is refused" rather than "the
# registry is unwell": 409 incompatible, 422 invalid schema.
_REFUSALS = frozenset({409, 422})

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
    ``subject``."""
    candidate = Schema(text, "AVRO")
    registered = _ask(subject, lambda: client.lookup_schema(subject, candidate))
    if registered is not None:
        return _Verdict(
            True,
            f"{subject}: {local} is version {registered.version} (id {registered.schema_id})",
        )
    versions = _ask(subject, lambda: client.get_versions(subject)) or []
    if not versions:
        return _Verdict(True, f"{subject}: new subject, {local} is registered at first publish")
    level = _level(client, subject)
    compatible, reason = _test(client, subject, candidate)
    where = f"subject {subject!r} (compatibility {level}, versions {versions})"
    if compatible:
        return _Verdict(
            True, f"{subject}: {local} is compatible with versions {versions} ({level})"
        )
    return _Verdict(False, f"{where} refuses {local}: {reason}")


def _level(client: SchemaRegistryClient, subject: str) -> str:
    level = _ask(subject, lambda: client.get_compatibility(subject))
    if level is None:  # no rule of its own: the registry's global one applies
        level = _ask(subject, client.get_compatibility) or "unknown"
    return str(level)


def _test(client: SchemaRegistryClient, subject: str, candidate: Schema) -> tuple[bool, str]:
    """The registry's verdict on ``candidate`` against the subject's versions (as its
    compatibility level says: the transitive levels test them all), with its reason.

    The client's ``test_compatibility_all_versions`` returns the verdict and drops the
    reason; the same request goes through the client's own REST transport to keep it
    (Confluent and Karapace answer ``messages``, Apicurio ``reason``)."""
    rest = getattr(client, "_rest_client", None)
    if rest is None:  # another client release: the verdict without the reason
        verdict = _ask(subject, lambda: client.test_compatibility_all_versions(subject, candidate))
        return bool(verdict), "(the client gave no reason)"
    path = f"compatibility/subjects/{_quoted(subject)}/versions?verbose=true"
    answer: Any = _ask(subject, lambda: rest.post(path, body=candidate.to_dict()))
    if not isinstance(answer, dict):
        return True, ""  # the subject went away meanwhile: nothing to be compatible with
    reasons = answer.get("messages") or answer.get("reason") or "(the registry gave no reason)"
    if isinstance(reasons, list):
        reasons = "; ".join(str(r) for r in reasons)
    return bool(answer.get("is_compatible")), redact(str(reasons))


def _quoted(subject: str) -> str:
    return quote(subject, safe="")


def _ask(subject: str, call: Callable[[], Any]) -> Any:
    """``call()``; None when the registry answers 404 (no such subject or schema)."""
    return registry_call(subject, call, "a check", missing_ok=True)


def registry_call(
    subject: str, call: Callable[[], Any], what: str, *, missing_ok: bool = False
) -> Any:
    """``call()``, a request about ``subject``, with the registry's errors mapped in one
    place (every message redacted): :class:`SchemaIncompatible` when it refuses ``what``
    (409 incompatible, 422 invalid schema); :class:`SchemaRegistryUnavailable` when it
    cannot answer (a server error, a transport failure); a 404 is None with
    ``missing_ok``, else unavailable too."""
    try:
        return call()
    except SchemaRegistryError as exc:
        if exc.http_status_code == _NOT_FOUND and missing_ok:
            return None
        if exc.http_status_code in _REFUSALS:
            raise SchemaIncompatible(
                f"the schema registry refused {what} under {subject!r}: "
                f"{redact(str(exc.error_message))}"
            ) from exc
        raise SchemaRegistryUnavailable(
            redact(f"schema registry error for {subject!r}: {exc}")
        ) from exc
    except Exception as exc:  # the client's transport raises its own (httpx) errors
        raise SchemaRegistryUnavailable(
            redact(f"schema registry unreachable for {subject!r}: {type(exc).__name__}: {exc}")
        ) from exc
