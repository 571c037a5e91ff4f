"""Availability through broker faults on a three-node Kafka cluster (issue #29).

    ./dev.sh bench --only cluster [--scale quick]

One run is tests/acceptance/test_cluster_availability.py's set-up, with its helpers
(``ride_out``, ``FAULTS``, tests/acceptance/cluster_faults.py): a fresh database granted by
`outbox-relay grant`, two in-process relays as the relay role, a 4-part JSON subscriber,
writers as the writer role committing 16 events every 20 ms or so (up to 800 events/s,
the issue's rate) throughout, and one fault 5 s after the writers start:

* ``leader``: ``kill -9`` of the node leading most of the subscriber's partitions;
* ``coordinator``: ``kill -9`` of the node coordinating most of the parts'
  transactional ids (the leader of their partitions of the transaction state log);
* ``rolling``: every node restarted in turn (controlled shutdown), each back in sync
  before the next.

A killed node stays down 60 s (the issue restarted its nodes 60 s later; ``quick``:
10 s), then restarts; the run goes on until every partition is back in sync, 5 s more,
and until every event is published. Per run: each part's longest time without its
checkpoint moving (its longest publishing gap), how many relays gave up their session,
the seconds no part had an owner while a relay was alive, the 1-minute load average at
the start and the end of the run, and whether every event reached Kafka exactly once in
per-key order (`verify`, then a read of the topic). The faults take turns, a c r a c r …,
for 3 rounds at every scale: a round takes about 6 minutes with the nodes down 60 s, and
3 rounds are what the issue asks for. Each figure is the median of the rounds with its
range; "runs over 15 s" counts the runs in which some part's gap broke the target.

The cluster is :class:`relay.localstack.LocalKafkaCluster` (replication factor 3,
``min.insync.replicas`` 2, the transaction state log likewise) with
``broker.session.timeout.ms`` 3000 (Kafka's default is 9000). The stack's single broker
is stopped meanwhile: its JVM would take CPU from the cluster's three.

Environment (for a narrower or a differently set run):
``OUTBOX_BENCH_CLUSTER_ROUNDS`` (default 3), ``OUTBOX_BENCH_CLUSTER_FAULTS`` (default
``leader,coordinator,rolling``), ``OUTBOX_BENCH_BROKER_SESSION_TIMEOUT_MS`` (default 3000),
``OUTBOX_BENCH_CLUSTER_DOWN_S`` (how long a killed node stays down; default 60, quick 10).
Every run's record is also appended to bench/results/cluster-runs.jsonl as it ends.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import psycopg

from bench.harness import RESULTS, SCHEMAS, Figure, Scale, Stack
from bench.method import Samples
from relay import Outbox
from relay.core.schemas import SchemaFolder
from relay.localstack import LocalKafkaCluster
from tests.acceptance.cluster_faults import PARTS, delivery_problems, ride_out
from tests.support import grant_test_roles

FAULTS = ("leader", "coordinator", "rolling")
ROUNDS = 3
TARGET_GAP_S = 15.0  # issue #29: each part's longest gap through one broker fault
PER_TRANSACTION = 16  # events per writer transaction, one every ~20 ms: up to 800 ev/s


def run(stack: Stack, scale: Scale) -> list[Figure]:
    rounds = int(os.environ.get("OUTBOX_BENCH_CLUSTER_ROUNDS", ROUNDS))
    faults = os.environ.get("OUTBOX_BENCH_CLUSTER_FAULTS", ",".join(FAULTS)).split(",")
    session_ms = os.environ.get("OUTBOX_BENCH_BROKER_SESSION_TIMEOUT_MS", "3000")
    down_for = float(
        os.environ.get("OUTBOX_BENCH_CLUSTER_DOWN_S", "10" if scale.name == "quick" else "60")
    )
    registry = SchemaFolder.from_dir(SCHEMAS)
    runs: dict[str, list[dict[str, Any]]] = {fault: [] for fault in faults}
    stack.broker.stop()  # its JVM would take CPU from the cluster's three
    try:
        cluster = LocalKafkaCluster(
            stack.workdir / f"cluster-{session_ms}",
            nodes=3,
            config={"broker.session.timeout.ms": session_ms},
        )
        with cluster:
            for round_ in range(rounds):
                for fault in faults:
                    record = _one(stack, cluster, registry, fault, down_for)
                    record.update(round=round_, broker_session_timeout_ms=int(session_ms))
                    _keep(record)
                    runs[fault].append(record)
    finally:
        stack.broker.start()
    setting = {"broker_session_timeout_ms": int(session_ms), "down_for_s": down_for}
    return [f for fault, done in runs.items() for f in _figures(fault, done, setting)]


class _SlowCalls(logging.Handler):
    """The relays' transactional calls that took long (relay/adapters/kafka/kafka.py logs each at INFO,
    event ``kafka_txn_call_slow``): where a part's gap went, and whether the watchdog
    gave any up."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []
        self.given_up = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:  # printed as ever
            logging.getLogger().handle(record)
        if getattr(record, "event", None) == "kafka_txn_call_slow":
            self.seconds.append(float(getattr(record, "seconds", 0.0)))
            self.given_up += "(given up)" in record.getMessage()


def _one(
    stack: Stack,
    cluster: LocalKafkaCluster,
    registry: SchemaFolder,
    fault: str,
    down_for: float,
) -> dict[str, Any]:
    """One run of ``fault`` on a new database; its record."""
    url, prefix, load_start = stack.fault_run("cluster", fault)
    roles = grant_test_roles(url)
    slow = _SlowCalls()
    kafka_log = logging.getLogger("relay.adapters.kafka.kafka")
    level = kafka_log.level
    kafka_log.addHandler(slow)
    kafka_log.setLevel(logging.INFO)
    kafka_log.propagate = False  # the INFO lines counted, not printed
    try:
        ridden = ride_out(
            [fault],
            roles,
            Outbox(registry),
            registry,
            cluster,
            prefix,
            down_for=down_for,
            per_transaction=PER_TRANSACTION,
        )
    finally:
        kafka_log.removeHandler(slow)
        kafka_log.setLevel(level)
        kafka_log.propagate = True
    load_end = os.getloadavg()[0]
    with psycopg.connect(roles.owner_url, autocommit=True) as db:
        problems = delivery_problems(db, cluster.bootstrap_servers, prefix + "outbox.event.order")
    seen = ridden.seen
    gaps = [round(seen.longest_gap.get(part, 0.0), 2) for part in range(PARTS)]
    record = {
        "fault": fault,
        "longest_gap_s": gaps,
        "sessions_dropped": sum(1 for s in seen.sessions.values() if len(s) != 1 or None in s),
        "ownerless_s": round(seen.ownerless_s, 2),
        "longest_ownerless_s": round(seen.longest_ownerless, 2),
        "load_start": round(load_start, 2),
        "load_end": round(load_end, 2),
        "events": ridden.written,
        "events_per_s": round(ridden.written / ridden.writing_s, 1),
        "delivery_problems": problems,
        "slow_txn_calls": len(slow.seconds),
        "longest_txn_call_s": round(max(slow.seconds, default=0.0), 2),
        "txn_calls_given_up": slow.given_up,
        "log": ridden.log,
    }
    print(f"   {json.dumps(record)}", file=sys.stderr, flush=True)
    return record


def _keep(record: dict[str, Any]) -> None:
    """Append one run's record to bench/results/cluster-runs.jsonl, so that a run cut
    short still leaves the rounds it finished."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "cluster-runs.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")


def _figures(fault: str, runs: list[dict[str, Any]], setting: dict[str, Any]) -> list[Figure]:
    if not runs:
        return []

    def samples(values: list[float]) -> Samples:
        return Samples(tuple(values))

    details = {**setting, "runs": runs}
    worst = [max(r["longest_gap_s"]) for r in runs]
    name = f"{fault}: "
    figures = [
        Figure.of("cluster", f"{name}part {part} longest gap",
                  samples([r["longest_gap_s"][part] for r in runs]), "s",
                  target=f"value<={TARGET_GAP_S:g}")
        for part in range(PARTS)
    ]  # fmt: skip
    figures += [
        Figure.of("cluster", f"{name}longest gap, any part", samples(worst), "s",
                  target=f"value<={TARGET_GAP_S:g}", details=details),
        Figure.of("cluster", f"{name}runs with a gap over {TARGET_GAP_S:g} s",
                  samples([float(sum(w > TARGET_GAP_S for w in worst))]), "runs",
                  target="value<=0"),
        Figure.of("cluster", f"{name}relays that gave up their session",
                  samples([r["sessions_dropped"] for r in runs]), "relays", target="value<=0"),
        Figure.of("cluster", f"{name}time with no part owned",
                  samples([r["ownerless_s"] for r in runs]), "s", target="value<=0"),
        Figure.of("cluster", f"{name}events not exactly once in key order (checks failed)",
                  samples([float(len(r["delivery_problems"])) for r in runs]), "checks",
                  target="value<=0"),
        Figure.of("cluster", f"{name}load average (1 min) at the run's end",
                  samples([r["load_end"] for r in runs]), "load"),
    ]  # fmt: skip
    return figures
