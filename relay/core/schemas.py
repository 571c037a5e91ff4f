"""Avro schemas from ``schemas/`` and Avro single-object encoding.

Layout: one named Avro schema per ``.avsc`` file, anywhere below the folder. The
writer schema of an event type is the schema whose full name (``namespace.Name``)
or, when unambiguous, simple name equals the event type. Earlier versions kept
for readers live in files named ``<anything>.v<N>.avsc``: they are indexed by
fingerprint for decoding but never used to write.

Values are self-describing: single-object encoding prefixes the Avro body with
``C3 01`` and the schema's 8-byte CRC-64-AVRO fingerprint, so a consumer can find
the writer schema (https://avro.apache.org/docs/current/specification/).
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
import fastavro._write
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form
from fastavro.validation import ValidationError, _validate, validate

from relay.core.log_fields import log_extra
from relay.errors import PayloadValidationError, SchemaError, UnknownEventTypeError

logger = logging.getLogger(__name__)

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
_HEADER_LEN = len(SINGLE_OBJECT_MAGIC) + 8
_HISTORY_FILE = re.compile(r"\.v\d+\.avsc$")
# schemaless_writer re-parses the schema on every call: half the cost of a 300-byte
# record. Its compiled core, write_data, takes the parsed schema once parsed; it is
# used only where fastavro is compiled (the pure-Python build has another signature).
_COMPILED_WRITE: Any = (
    getattr(fastavro._write, "write_data", None)
    if getattr(fastavro._write, "CYTHON_MODULE", 0)
    else None
)
_VALIDATE_OPTIONS = {"strict": False, "disable_tuple_notation": False}
_WRITE_OPTIONS = {"strict": False, "strict_allow_default": False, "disable_tuple_notation": False}


@dataclass(frozen=True)
class AvroSchema:
    full_name: str
    parsed: Any
    fingerprint: bytes  # 8 bytes, the order single-object encoding writes them
    path: Path | None = None
    named: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def header(self) -> bytes:
        return SINGLE_OBJECT_MAGIC + self.fingerprint

    @classmethod
    def from_json(cls, schema: Mapping[str, Any], path: Path | None = None) -> AvroSchema:
        named: dict[str, Any] = {}
        try:
            parsed = parse_schema(dict(schema), named_schemas=named, _write_hint=False)
            canonical = to_parsing_canonical_form(parsed)
        except Exception as exc:  # fastavro raises several unrelated types
            raise SchemaError(f"invalid Avro schema{f' in {path}' if path else ''}: {exc}") from exc
        if not isinstance(parsed, dict) or "name" not in parsed:
            raise SchemaError(f"{path or 'schema'}: must be a named Avro type (a record)")
        return cls(
            parsed["name"],
            parsed,
            bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")),
            path,
            named,
        )


class SchemaFolder:
    """The ``.avsc`` files of one folder: event type → writer schema, fingerprint → any
    known schema. Local files only; not a Confluent-style schema registry service."""

    def __init__(self, writers: Sequence[AvroSchema], history: Sequence[AvroSchema] = ()) -> None:
        self._by_fingerprint = {s.fingerprint: s for s in [*history, *writers]}
        self._by_name: dict[str, AvroSchema] = {}
        simple: dict[str, list[AvroSchema]] = {}
        for schema in writers:
            if schema.full_name in self._by_name:
                raise SchemaError(
                    f"two writer schemas named {schema.full_name!r}: "
                    f"{self._by_name[schema.full_name].path} and {schema.path}"
                )
            self._by_name[schema.full_name] = schema
            simple.setdefault(schema.full_name.rsplit(".", 1)[-1], []).append(schema)
        for name, candidates in simple.items():
            if len(candidates) == 1:
                self._by_name.setdefault(name, candidates[0])

    @classmethod
    def from_dir(cls, folder: Path | str) -> SchemaFolder:
        root = Path(folder)
        if not root.is_dir():
            raise SchemaError(f"schemas folder {root} does not exist")
        writers: list[AvroSchema] = []
        history: list[AvroSchema] = []
        for path in sorted(root.rglob("*.avsc")):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                # Hidden: a ConfigMap or Secret volume holds each file three times, as
                # NAME, ..data/NAME and ..<timestamp>/NAME; NAME alone is the file.
                continue
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise SchemaError(f"cannot read Avro schema {path}: {exc}") from exc
            schema = AvroSchema.from_json(document, path)
            (history if _HISTORY_FILE.search(path.name) else writers).append(schema)
        logger.debug(
            "loaded %s writer schemas from %s",
            len(writers),
            root,
            extra=log_extra("schemas_loaded", schemas=len(writers), folder=root),
        )
        return cls(writers, history)

    @property
    def event_types(self) -> list[str]:
        return sorted({s.full_name for s in self._by_name.values()})

    def writer_for(self, event_type: str) -> AvroSchema:
        try:
            return self._by_name[event_type]
        except KeyError:
            raise UnknownEventTypeError(event_type) from None

    def schemas(self) -> list[AvroSchema]:
        """Every known schema, writers and history."""
        return list(self._by_fingerprint.values())

    def by_fingerprint(self, fp: bytes) -> AvroSchema | None:
        return self._by_fingerprint.get(fp)

    def validate(self, event_type: str, payload: Any) -> AvroSchema:
        """Check ``payload`` (JSON-shaped) against the event type's schema."""
        schema = self.writer_for(event_type)
        # The quiet check first: with raise_errors, fastavro builds (and formats) an
        # error for every union branch it tries and rejects, even on valid payloads.
        if validate(payload, schema.parsed, raise_errors=False):
            return schema
        problems = _record_problems(payload, schema.parsed, schema.named, schema.full_name)
        if problems:
            raise PayloadValidationError(event_type, problems)
        try:
            validate(payload, schema.parsed, raise_errors=True)
        except ValidationError as exc:
            raise PayloadValidationError(event_type, _problems(exc)) from exc
        return schema

    def encode(self, event_type: str, payload: Any) -> bytes:
        """Single-object encoding of ``payload`` with the event type's writer schema."""
        schema = self.writer_for(event_type)
        return encode_with(schema, payload)

    def decode(self, data: bytes, reader: AvroSchema | None = None) -> tuple[AvroSchema, Any]:
        """Decode a single-object-encoded value; resolve it to ``reader`` if given."""
        if len(data) < _HEADER_LEN or not data.startswith(SINGLE_OBJECT_MAGIC):
            raise SchemaError("value is not Avro single-object encoded (bad magic bytes)")
        writer = self.by_fingerprint(data[2:_HEADER_LEN])
        if writer is None:
            raise SchemaError(f"unknown writer schema fingerprint {data[2:_HEADER_LEN].hex()}")
        body = io.BytesIO(data[_HEADER_LEN:])
        reader_schema = reader.parsed if reader is not None else None
        return writer, fastavro.schemaless_reader(body, writer.parsed, reader_schema)


def encode_with(schema: AvroSchema, payload: Any) -> bytes:
    try:
        if _COMPILED_WRITE is not None:
            buffer = bytearray(schema.header)
            _COMPILED_WRITE(buffer, payload, schema.parsed, schema.named, "", _WRITE_OPTIONS)
            return bytes(buffer)
        stream = io.BytesIO()
        stream.write(schema.header)
        fastavro.schemaless_writer(stream, schema.parsed, payload)
        return stream.getvalue()
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise PayloadValidationError(schema.full_name, [str(exc)]) from exc


def _record_problems(datum: Any, schema: Any, named: dict[str, Any], path: str) -> list[str]:
    """Every field of a record that does not match, nested records field by field
    (fastavro's own check stops at the first one, so a writer fixed one problem per
    try). Empty when ``datum`` is not a record's mapping: fastavro says why."""
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if not (isinstance(schema, dict) and schema.get("type") == "record"):
        return []
    if not isinstance(datum, Mapping):
        return []
    problems = []
    for field_schema in schema["fields"]:
        name, kind = field_schema["name"], field_schema["type"]
        where = f"{path}.{name}"
        if name not in datum:
            if "default" not in field_schema:
                problems.append(f"{where} is missing")
            continue
        nested = _record_problems(datum[name], kind, named, where)
        if nested:
            problems.extend(nested)
            continue
        try:
            _validate(datum[name], kind, named, where, True, _VALIDATE_OPTIONS)
        except ValidationError as exc:
            problems.extend(_problems(exc))
    return problems


def _problems(exc: ValidationError) -> list[str]:
    try:
        problems = json.loads(str(exc))
    except ValueError:
        return [str(exc)]
    return [str(p) for p in problems] if isinstance(problems, list) else [str(problems)]
