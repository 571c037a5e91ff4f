"""What a value format is to the relay, as one object (:class:`Format`): how its
values are written, what it needs configured before a subscriber may publish it, and
the traits the rest of the relay asks of it instead of naming it. Each format is one
module of this package; ``relay/core/formats/__init__.py`` registers them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from relay.core.model import KafkaRecord, OutboxEvent

if TYPE_CHECKING:
    from relay.core.schemas import SchemaFolder
    from relay.core.settings import Settings
    from relay.core.subscribers import SubjectStrategy, Subscriber

# A value: (event, topic) to its bytes; EncodingError marks a poison event.
ValueWriter = Callable[[OutboxEvent, str], bytes]
# A whole record, for a format that decides its key, topic and headers itself.
RecordWriter = Callable[[OutboxEvent], KafkaRecord]


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
    - ``relay_headers``: its records carry the relay's headers (verify needs them).
    """

    values: Callable[[Encoders, Subscriber], ValueWriter] | None = None
    records: Callable[[Encoders, Subscriber], RecordWriter] | None = None
    refusal: Callable[[str, Settings, bool], str | None] = lambda name, settings, has: None
    local: bool = False
    registry: bool = False
    envelope: bool = False
    fixed_routing: str | None = None
    relay_headers: bool = True
