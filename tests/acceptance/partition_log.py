"""A partition's log as it is on a node's disk, read with Kafka's own DumpLogSegments
(from the jars the local cluster runs): each batch's producer id and epoch, its
sequence numbers, and the transaction markers, so a test can tell which transaction
each record belongs to, how that transaction ended, and at which epoch a retry ran.
A consumer sees none of that: read_committed hides the aborted records, and
read_uncommitted shows them without saying they were aborted."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from relay.artifacts.maven import fetch_lock
from relay.localstack import LocalKafka
from relay.localstack.kafka import find_java

_BATCH = re.compile(
    r"baseOffset: (?P<offset>\d+) .*?baseSequence: (?P<sequence>-?\d+) .*?"
    r"producerId: (?P<pid>-?\d+) producerEpoch: (?P<epoch>-?\d+) .*?"
    r"isTransactional: (?P<txn>\w+) isControl: (?P<control>\w+)"
)
_MARKER = re.compile(r"endTxnMarker: (?P<marker>[A-Z]+)")
_PAYLOAD = re.compile(r"\| offset: \d+ .*? payload: (?P<payload>.*)$")


@dataclass
class LogBatch:
    """One batch of the log: data records, or a transaction marker (``marker``)."""

    offset: int
    producer_id: int
    epoch: int
    base_sequence: int
    transactional: bool
    marker: str | None = None
    payloads: list[str] = field(default_factory=list)


@dataclass
class Transaction:
    """A producer's data batches up to the marker that ended them."""

    producer_id: int
    epoch: int
    outcome: str  # COMMIT, ABORT, or OPEN (no marker yet)
    batches: list[LogBatch]

    @property
    def payloads(self) -> list[str]:
        return [p for b in self.batches for p in b.payloads]


def read_log(node: LocalKafka, topic: str, partition: int = 0) -> list[LogBatch]:
    """Every batch of ``topic``'s ``partition`` in ``node``'s log directory, in order."""
    segments = sorted((node.work_dir / "data" / f"{topic}-{partition}").glob("*.log"))
    java, _ = find_java()
    classpath = ":".join(str(j) for j in fetch_lock("kafka", progress=None))
    argv = [java, "-cp", classpath, "kafka.tools.DumpLogSegments", "--deep-iteration"]
    argv += ["--print-data-log", "--files", ",".join(map(str, segments))]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    return _parse(out.splitlines())


def _parse(lines: Iterable[str]) -> list[LogBatch]:
    batches: list[LogBatch] = []
    for line in lines:
        if (batch := _BATCH.search(line)) is not None:
            batches.append(
                LogBatch(
                    int(batch["offset"]),
                    int(batch["pid"]),
                    int(batch["epoch"]),
                    int(batch["sequence"]),
                    batch["txn"] == "true",
                )
            )
        elif batches and (marker := _MARKER.search(line)) is not None:
            batches[-1].marker = marker["marker"]
        elif batches and (record := _PAYLOAD.search(line)) is not None:
            batches[-1].payloads.append(record["payload"])
    return batches


def transactions(batches: Iterable[LogBatch]) -> list[Transaction]:
    """The log's transactions, in the order they ended: each producer's data batches
    are closed by its next marker (the epoch is the marker's)."""
    open_batches: dict[int, list[LogBatch]] = {}
    ended: list[Transaction] = []
    for batch in batches:
        if not batch.transactional:
            continue
        if batch.marker is None:
            open_batches.setdefault(batch.producer_id, []).append(batch)
            continue
        data = open_batches.pop(batch.producer_id, [])
        ended.append(Transaction(batch.producer_id, batch.epoch, batch.marker, data))
    for pid, data in open_batches.items():
        ended.append(Transaction(pid, data[-1].epoch, "OPEN", data))
    return ended


def retries_after_aborts(ended: list[Transaction]) -> tuple[int, int]:
    """Of the aborted transactions that held records, how many were followed (by the
    same producer's next transaction with records) at the same epoch, and how many at
    a later one."""
    same = later = 0
    for i, txn in enumerate(ended):
        if txn.outcome != "ABORT" or not txn.batches:
            continue
        following = next(
            (t for t in ended[i + 1 :] if t.producer_id == txn.producer_id and t.batches), None
        )
        if following is None:
            continue
        if following.batches[0].epoch == txn.batches[0].epoch:
            same += 1
        else:
            later += 1
    return same, later
