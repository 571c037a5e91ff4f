"""Client-side ``read_committed`` for brokers that do not filter aborted transactions.

Tansu (the embedded test broker) writes proper transaction control batches into the log
(COMMIT/ABORT markers carrying the producer id), but its Fetch responses always carry an
empty ``aborted_transactions`` list, so a ``read_committed`` consumer also sees records of
aborted transactions. This module reads the raw log instead and decides from the markers,
the way a Kafka broker's aborted-transaction index would:

* a record of a non-transactional batch is visible;
* a record of a transactional batch from producer id P belongs to P's open transaction on
  that partition; the next control batch from P on that partition ends it: COMMIT makes
  the records visible, ABORT drops them (this covers fencing too: the broker aborts the
  old producer's transaction with an ABORT marker under the same producer id);
* a transaction with no marker yet (up to the high watermark at the time of the call) is
  still *open*: its records are reported in :attr:`LogSnapshot.open`, never as committed;
* control records themselves are never returned.

Wire protocol: Fetch v4 (READ_UNCOMMITTED) over a plain socket, hand-encoded because the
format is stable (Apache Kafka 4.x still serves it) while kafka-python's network client is
not; record batches are decoded by kafka-python's ``kafka.record.MemoryRecords`` (codecs,
v2 batch header). Metadata and watermarks come from confluent-kafka.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from kafka.record import MemoryRecords  # type: ignore[import-untyped]

__all__ = ["LogSnapshot", "RawRecord", "committed_records", "read_log"]

_FETCH_API_KEY = 1
_FETCH_VERSION = 4  # non-flexible, magic v2 batches, still served by Kafka 4.x
_READ_UNCOMMITTED = 0  # we want the markers and every data batch up to the high watermark
_ABORT, _COMMIT = 0, 1  # control record key: int16 version, int16 type
_CLIENT_ID = b"kafka-markers"
_correlation_ids = itertools.count(1)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawRecord:
    """One data record exactly as stored in the log."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass
class LogSnapshot:
    """Every data record of a topic, split by the fate of its transaction.

    Each list is sorted by (partition, offset)."""

    committed: list[RawRecord] = field(default_factory=list)  # incl. non-transactional
    aborted: list[RawRecord] = field(default_factory=list)
    open: list[RawRecord] = field(default_factory=list)  # transaction without marker yet
    # Log shapes a Kafka broker would not write, e.g. a marker for an epoch that was
    # already fenced; described for diagnosis.
    anomalies: list[str] = field(default_factory=list)


def committed_records(bootstrap_servers: str, topic: str, timeout: float = 30.0) -> list[RawRecord]:
    """Records of ``topic`` a correct ``read_committed`` consumer would see, reading every
    partition from its log start to its high watermark as of this call, in (partition,
    offset) order. Records of still-open transactions are excluded, with a warning logged
    (:func:`read_log` returns them too)."""
    snapshot = read_log(bootstrap_servers, topic, timeout)
    if snapshot.open:
        _log.warning("%s: %d records of open transactions excluded", topic, len(snapshot.open))
    return snapshot.committed


def read_log(bootstrap_servers: str, topic: str, timeout: float = 30.0) -> LogSnapshot:
    """Read all partitions of ``topic`` and classify each data record (see module doc)."""
    deadline = time.monotonic() + timeout

    def remaining() -> float:
        return max(deadline - time.monotonic(), 0.1)

    leaders = _partition_leaders(bootstrap_servers, topic, remaining())
    bounds = _watermarks(bootstrap_servers, topic, sorted(leaders), remaining())
    snapshot = LogSnapshot()
    sockets: dict[tuple[str, int], socket.socket] = {}
    try:
        for partition in sorted(leaders):
            address = leaders[partition]
            if address not in sockets:
                sockets[address] = socket.create_connection(address, timeout=remaining())
            low, high = bounds[partition]
            batches = _read_batches(sockets[address], topic, partition, low, high, deadline)
            _classify(topic, partition, low, batches, snapshot)
    finally:
        for sock in sockets.values():
            sock.close()
    for records in (snapshot.committed, snapshot.aborted, snapshot.open):
        records.sort(key=lambda r: (r.partition, r.offset))
    return snapshot


def _classify(topic: str, partition: int, start: int, batches: list[Any], out: LogSnapshot) -> None:
    # producer id -> (epoch, records) of its open transaction. A producer epoch only
    # grows; data from a newer epoch means the older transaction was fenced, which
    # aborts it (Kafka writes that ABORT marker; a late or missing one changes nothing).
    pending: dict[int, tuple[int, list[RawRecord]]] = {}
    for batch in batches:
        pid, epoch = batch.producer_id, batch.producer_epoch
        if batch.is_control_batch:
            for control in batch:
                _version, kind = struct.unpack_from(">hh", control.key)
                if kind not in (_ABORT, _COMMIT):  # other control types end nothing
                    continue
                if pid in pending and pending[pid][0] <= epoch:
                    txn = pending.pop(pid)[1]
                    (out.committed if kind == _COMMIT else out.aborted).extend(txn)
                elif pid in pending:
                    out.anomalies.append(
                        f"{topic}[{partition}]@{batch.base_offset}: marker of fenced epoch "
                        f"{epoch} for producer {pid}, whose epoch {pending[pid][0]} is open"
                    )
        elif batch.is_transactional:
            if pid in pending and pending[pid][0] < epoch:
                fenced_epoch, fenced = pending.pop(pid)
                out.aborted.extend(fenced)
                out.anomalies.append(
                    f"{topic}[{partition}]@{batch.base_offset}: producer {pid} epoch {epoch} "
                    f"writes while epoch {fenced_epoch} has no marker yet"
                )
            txn = pending.setdefault(pid, (epoch, []))[1]
            txn.extend(_records(topic, partition, start, batch))
        else:
            out.committed.extend(_records(topic, partition, start, batch))
    for _epoch, txn in pending.values():
        out.open.extend(txn)


def _records(topic: str, partition: int, start: int, batch: Any) -> list[RawRecord]:
    # A fetch may start inside a batch (log start offset): skip records before ``start``.
    return [
        RawRecord(topic, partition, r.offset, r.key, r.value, list(r.headers))
        for r in batch
        if r.offset >= start
    ]


def _partition_leaders(bootstrap: str, topic: str, timeout: float) -> dict[int, tuple[str, int]]:
    # Ask for all topics: a metadata request naming the topic makes Tansu create it.
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=timeout)
    info = metadata.topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        raise LookupError(f"topic {topic!r} not found: {info.error if info else 'no metadata'}")
    brokers = metadata.brokers
    return {
        p: (str(brokers[m.leader].host), brokers[m.leader].port) for p, m in info.partitions.items()
    }


def _watermarks(
    bootstrap: str, topic: str, partitions: list[int], timeout: float
) -> dict[int, tuple[int, int]]:
    """(log start offset, high watermark) of each partition, as of now."""
    # read_uncommitted: the end is the high watermark, not the last stable offset (which
    # stops before the first open transaction, hiding it and everything after it).
    config = {"group.id": "kafka-markers-unused", "isolation.level": "read_uncommitted"}
    consumer = Consumer({"bootstrap.servers": bootstrap, **config})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            for p in partitions
        }
    finally:
        consumer.close()


def _read_batches(
    sock: socket.socket, topic: str, partition: int, start: int, end: int, deadline: float
) -> list[Any]:
    """Every record batch (data and control) covering offsets ``start`` to ``end - 1``."""
    batches: list[Any] = []
    offset, max_bytes = start, 1 << 20
    while offset < end:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic}[{partition}]: read up to {offset} of {end}")
        data = _fetch(sock, topic, partition, offset, max_bytes)
        complete = [b for b in MemoryRecords(data) if _v2(b).next_offset > offset]
        if not complete:
            # Only a truncated batch came (Kafka and Tansu send an oversized first batch
            # whole, so this is defensive): ask for more bytes. Nothing came: retry.
            if data:
                max_bytes = min(max_bytes * 2, 1 << 30)
            else:
                time.sleep(0.05)
            continue
        batches.extend(complete)
        offset = complete[-1].next_offset
    return batches


def _v2(batch: Any) -> Any:
    if batch.magic < 2:  # pre-0.11 message sets have no producer ids or markers
        raise ValueError(f"legacy message format v{batch.magic} at offset {batch.base_offset}")
    return batch


def _fetch(sock: socket.socket, topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
    """One Fetch v4 round trip for one partition; returns its raw record-set bytes."""
    name = topic.encode()
    # replica id (-1: a client), max wait ms, min bytes, max bytes, isolation level
    body = struct.pack(">iiiib", -1, 500, 1, max_bytes, _READ_UNCOMMITTED)
    body += struct.pack(">ih", 1, len(name)) + name  # one topic
    body += struct.pack(">iiqi", 1, partition, offset, max_bytes)  # one partition
    request_id = next(_correlation_ids) & 0x7FFFFFFF
    header = struct.pack(">hhih", _FETCH_API_KEY, _FETCH_VERSION, request_id, len(_CLIENT_ID))
    request = header + _CLIENT_ID + body
    sock.sendall(struct.pack(">i", len(request)) + request)
    (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
    response = memoryview(_recv_exactly(sock, size))
    correlation_id, _throttle, _topics, name_len = struct.unpack_from(">iiih", response)
    if correlation_id != request_id:
        raise ConnectionError(f"fetch correlation id mismatch: {correlation_id}")
    pos = 14 + name_len + 4  # skip the topic name and the partition count (always 1)
    _partition, error, _high, _lso, aborted = struct.unpack_from(">ihqqi", response, pos)
    if error:
        raise RuntimeError(f"fetch {topic}[{partition}]@{offset}: Kafka error code {error}")
    pos += 26 + 16 * max(aborted, 0)  # aborted_transactions (empty for READ_UNCOMMITTED)
    (length,) = struct.unpack_from(">i", response, pos)
    return bytes(response[pos + 4 : pos + 4 + length]) if length > 0 else b""


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
