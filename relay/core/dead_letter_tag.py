"""The dead letters a Kafka-side checkpoint names (docs/design.md §7), written compactly.

An owner that adopts a Kafka-side checkpoint (a crash fell between the Kafka commit and
the Postgres one) records the dead-letter decisions of that transaction, so the
checkpoint's tag (offset-commit metadata, at most ``offset.metadata.max.bytes``: 4 KiB
by default) names them. It named each by its message id: 32 a transaction, and a flood
of poison rows was dead-lettered 32 at a time (issue #47). It now names them by their
keys, which the recovering owner looks up in the outbox: per dead-letter topic, the
keys as deltas from the one before (varints), deflated and in base64. A batch's keys
ascend and sit close together, so a run of consecutive positions costs a few bytes in
all, and rows spread over many parts about a byte each; :func:`fitting` tells the
worker how many of a batch's dead letters fit, and the batch is cut there.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Sequence
from typing import Any

from relay.core.model import Position

# What the dead letters may take of the tag: the rest (the key space and the last
# message id, about 100 bytes) stays within the relay's 4,000 of the broker's 4,096.
MAX_TAG_BYTES = 3800
# A tag's keys, inflated, at most: a tag is read from the checkpoint group, which
# another client of the cluster could write; 16 MiB holds 100,000 keys (the largest
# batch_size) of any spread.
_MAX_INFLATED = 16 * 2**20

# The tag's fields: topics, and each topic's keys (parallel lists). Relays before
# issue #47 wrote "dead_letters" (message ids) instead, and read only that.
TOPICS = "dead_letter_topics"
KEYS = "dead_letter_keys"
NAMED = "dead_letters"
_START = Position(0, 0)  # what each topic's first key is a delta from


class Named:
    """A tag's dead letters, named one at a time (a batch's, as the worker decides
    them): cheap to add to, measured by :meth:`size`."""

    def __init__(self) -> None:
        self._raw: dict[str, bytearray] = {}  # per topic, the varints so far
        self._last: dict[str, Position] = {}
        self.count = 0

    def add(self, key: Position, topic: str) -> None:
        raw = self._raw.get(topic)
        if raw is None:
            raw = self._raw[topic] = bytearray()
        tx, pos = self._last.get(topic, _START)
        if key.transaction_id == tx:
            _put(raw, _zigzag(key.position - pos) << 1)
        else:
            _put(raw, _zigzag(key.transaction_id - tx) << 1 | 1)
            _put(raw, _zigzag(key.position - pos))
        self._last[topic] = key
        self.count += 1

    def fields(self) -> dict[str, Any]:
        """The tag's fields; none when there are no dead letters."""
        if not self._raw:
            return {}
        topics = sorted(self._raw)
        return {TOPICS: topics, KEYS: [_deflate(self._raw[topic]) for topic in topics]}

    def size(self) -> int:
        """The bytes :meth:`fields` take in the tag."""
        return len(json.dumps(self.fields(), separators=(",", ":")))


def fields(letters: Sequence[tuple[Position, str]]) -> dict[str, Any]:
    """The tag's fields naming ``letters`` ((key, dead-letter topic), in batch order);
    none when there are none."""
    return _named(letters).fields()


def fitting(letters: Sequence[tuple[Position, str]]) -> int:
    """How many of ``letters`` (a prefix) a tag can name within :data:`MAX_TAG_BYTES`."""
    if _size(letters) <= MAX_TAG_BYTES:
        return len(letters)
    fit, over = 0, len(letters)  # the answer is in [fit, over)
    while over - fit > 1:
        middle = (fit + over) // 2
        if _size(letters[:middle]) <= MAX_TAG_BYTES:
            fit = middle
        else:
            over = middle
    return fit


def read(tag: dict[str, Any]) -> tuple[tuple[Position, str], ...]:
    """The (key, topic) pairs a tag names; ValueError when it cannot be read."""
    if KEYS not in tag:  # none, or named by message id (:data:`NAMED`)
        return ()
    topics, encoded = tag.get(TOPICS), tag[KEYS]
    if not isinstance(topics, list) or not isinstance(encoded, list):
        raise ValueError("dead-letter fields of the tag are not lists")
    if len(encoded) != len(topics):
        raise ValueError("dead-letter topics and keys do not pair up")
    pairs = zip(topics, encoded, strict=True)
    return tuple((key, str(topic)) for topic, text in pairs for key in _decode(text))


def _size(letters: Sequence[tuple[Position, str]]) -> int:
    return _named(letters).size()


def _named(letters: Sequence[tuple[Position, str]]) -> Named:
    named = Named()
    for key, topic in letters:
        named.add(key, topic)
    return named


def _deflate(raw: bytearray) -> str:
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def _decode(text: object) -> list[Position]:
    if not isinstance(text, str):
        raise ValueError("dead-letter keys are not text")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text, validate=True), _MAX_INFLATED)
    except (binascii.Error, zlib.error) as exc:
        raise ValueError(f"dead-letter keys cannot be read: {exc}") from exc
    if inflater.unconsumed_tail or not inflater.eof:
        raise ValueError("dead-letter keys are cut short or too long")
    keys: list[Position] = []
    tx, pos, at = 0, 0, 0
    while at < len(raw):
        head, at = _get(raw, at)
        if head & 1:
            tx += _unzigzag(head >> 1)
            delta, at = _get(raw, at)
            pos += _unzigzag(delta)
        else:
            pos += _unzigzag(head >> 1)
        keys.append(Position(tx, pos))
    return keys


def _zigzag(n: int) -> int:
    return n << 1 if n >= 0 else (-n << 1) - 1


def _unzigzag(n: int) -> int:
    return n >> 1 if not n & 1 else -((n + 1) >> 1)


def _put(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)


def _get(raw: bytes, at: int) -> tuple[int, int]:
    n, shift = 0, 0
    while True:
        if at >= len(raw) or shift > 70:
            raise ValueError("dead-letter keys end inside a number")
        byte = raw[at]
        at += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, at
