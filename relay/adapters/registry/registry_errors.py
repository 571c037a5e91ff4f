"""The schema registry's errors, mapped to the relay's in one place (as kafka_errors.py
does for Kafka), and the registry's own text made safe to show.

The registry is a peer the relay does not control: a broken or hostile one can answer
a 200 KB error text full of terminal escape sequences and newlines that forge log
lines. Every text of its answers that the relay logs, stores (a halt's reason) or
prints (``status``) goes through :func:`registry_text` first: control characters
escaped, the length capped.

A fault of the registry is never the events' fault nor the operator's: a server error,
a timeout and an answer that cannot be right are :class:`SchemaRegistryUnavailable`
(retried with backoff). Only the registry's refusal of a schema (422 invalid, or a 409
its own compatibility test confirms: relay/adapters/registry/registration.py) is
:class:`SchemaIncompatible`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka.schema_registry.error import SchemaRegistryError

from relay.core.redact import redact
from relay.core.terminal import printable
from relay.errors import SchemaIncompatible, SchemaRegistryFault, SchemaRegistryUnavailable

__all__ = ["CONFLICT", "MAX_TEXT", "registry_call", "registry_text"]

NOT_FOUND = 404
# "Conflict": Confluent's answer for an incompatible schema, but also Apicurio's for an
# artifact two requests created at once. Only the compatibility test tells them apart.
CONFLICT = 409
_INVALID = 422  # the schema itself is refused (not valid under the registry's parser)

# Characters of the registry's text kept: enough for any real reason (Apicurio's name
# the field and both types), far below what a hostile answer can send.
MAX_TEXT = 1000


def registry_text(text: object, limit: int = MAX_TEXT) -> str:
    """``text`` from the registry as the relay may show it: at most ``limit`` of its
    characters (then how long it was), every control character escaped (``\\x1b``,
    ``\\n``: one line, no terminal sequence), secrets masked."""
    shown = str(text)
    if len(shown) > limit:
        shown = f"{shown[:limit]}...[cut: {len(shown)} characters]"
    return redact(printable(shown))


def registry_call(
    subject: str, call: Callable[[], Any], what: str, *, missing_ok: bool = False
) -> Any:
    """``call()``, a request about ``subject``, with the registry's errors mapped in one
    place (every message made safe by :func:`registry_text`): :class:`SchemaIncompatible`
    when it refuses ``what`` as invalid (422); :class:`SchemaRegistryUnavailable` when it
    cannot answer (a server error, a transport failure, an answer the client cannot
    read); a 404 is None with ``missing_ok``, else unavailable too; a 409 is
    :class:`SchemaRegistryFault` here (a conflict is only a refusal once the registry's
    compatibility test says so: the registration asks it)."""
    try:
        return call()
    except SchemaRegistryError as exc:
        status = exc.http_status_code
        if status == NOT_FOUND and missing_ok:
            return None
        said = registry_text(exc)
        if status == _INVALID:
            raise SchemaIncompatible(
                f"the schema registry refused {what} under {subject!r} as invalid: {said}"
            ) from exc
        if status == CONFLICT:
            raise SchemaRegistryFault(
                f"the schema registry answered a conflict about {what} under {subject!r}: {said}"
            ) from exc
        raise SchemaRegistryUnavailable(f"schema registry error for {subject!r}: {said}") from exc
    except (SchemaIncompatible, SchemaRegistryUnavailable):
        raise  # already mapped (a nested registry_call)
    except Exception as exc:  # the client's transport raises its own (httpx) errors
        raise SchemaRegistryUnavailable(
            f"schema registry unreachable for {subject!r}: {type(exc).__name__}: "
            f"{registry_text(exc)}"
        ) from exc
