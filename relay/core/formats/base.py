"""What a value format is to the relay, as one object (:class:`Format`): how its
values are written, what it needs configured before a subscriber may publish it, and
the traits the rest of the relay asks of it instead of naming it. Each format is one
module of this package; ``relay/core/formats/__init__.py`` registers them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from relay.core.model import KafkaRecord, OutboxEvent

if TYPE_CHECKING:
    from relay.core.schemas import SchemaFolder

# A value: (event, topic) to its bytes; EncodingError marks a poison event.
ValueWriter = Callable[[OutboxEvent, str], bytes]
# A whole record, for a format that decides its key, topic and headers itself.
RecordWriter = Callable[[OutboxEvent], KafkaRecord]


class SubjectStrategy(StrEnum):
    """The registry subject an avro-registry value's schema is registered under, as
    Confluent's TopicNameStrategy, RecordNameStrategy and TopicRecordNameStrategy."""

    TOPIC = "topic"  # <topic>-value
    RECORD = "record"  # <record full name>
    TOPIC_RECORD = "topic-record"  # <topic>-<record full name>

    def subject(self, topic: str, record: str) -> str:
        if self is SubjectStrategy.TOPIC:
            return f"{topic}-value"
        if self is SubjectStrategy.RECORD:
            return record
        return f"{topic}-{record}"


class Subscribed(Protocol):
    """What a format reads of its subscriber (relay/core/subscribers.py's
    ``Subscriber``, which asks the formats for their traits: named here, not imported)."""

    @property
    def name(self) -> str: ...

    @property
    def subject_strategy(self) -> SubjectStrategy: ...

    @property
    def free_fields(self) -> frozenset[str]: ...

    def topic_for(self, event: OutboxEvent) -> str: ...


class Configured(Protocol):
    """What a format's precondition reads of the settings (relay/core/settings.py's)."""

    @property
    def schemas_dir(self) -> Path | None: ...

    @property
    def schema_registry_url(self) -> str | None: ...


class SchemaRegistry(Protocol):
    """The schema registry's encoder as the formats use it (relay/adapters/registry/
    registry_format.py's, built by the daemon: the core names no adapter)."""

    @property
    def schemas(self) -> SchemaFolder | None: ...

    def encode(
        self, topic: str, event_type: str, payload: Any, strategy: SubjectStrategy
    ) -> bytes: ...

    def encode_key(self, topic: str, key: str) -> bytes: ...

    def frame_text(self, subject: str, text: str, body: bytes) -> bytes: ...


class Encoders(Protocol):
    """What a format's writer reads when it writes, each time (not once when it is
    made): the writer schemas loaded and the schema registry's encoder, None when not
    configured (the record encoder of relay/engine/encoding.py)."""

    @property
    def registry(self) -> SchemaFolder | None: ...

    @property
    def schema_registry(self) -> SchemaRegistry | None: ...


@dataclass(frozen=True)
class Format:
    """One value format.

    - ``values``: its value writer for a subscriber, or None when ``records`` writes
      the whole record;
    - ``refusal``: why a subscriber of this format cannot publish under these settings
      (``has_schemas``: whether writer schemas are loaded), or None; checked by
      ``subscribers add``/``set`` and the relay's start-up;
    - ``local``: encoded without asking a registry, so encoding an event again gives
      the same record or the same error (the worker encodes such batches in one loop);
    - ``registry``: its values are registered in a schema registry (subject strategy,
      avro-registry keys, the registry's compatibility check);
    - ``envelope``: the value's shape is free, so a placement may put fields in it;
    - ``fixed_routing``: why it takes no key, partition or placements (None: it does);
    - ``relay_headers``: its records carry the relay's headers (verify needs them);
    - ``raw_payloads``: its values take the payload as the JSON text Postgres returns
      (bytes), unloaded: the fetch leaves it so (``Selection.raw_payloads``);
    - ``passed_through``: the format a subscriber of this one publishes instead when its
      routing reads nothing of the payload (default key, no partition field, no
      placements): one with ``raw_payloads`` (docs/design.md, "Value formats").
    """

    values: Callable[[Encoders, Subscribed], ValueWriter] | None = None
    records: Callable[[Encoders, Subscribed], RecordWriter] | None = None
    refusal: Callable[[str, Configured, bool], str | None] = lambda name, settings, has: None
    local: bool = False
    registry: bool = False
    envelope: bool = False
    fixed_routing: str | None = None
    relay_headers: bool = True
    raw_payloads: bool = False
    passed_through: Format | None = None
