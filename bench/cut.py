"""One relay cut from Postgres, from Kafka, or both: the other parts' stall (issue #49).

    ./dev.sh bench --only cut [--scale quick]

One run is tests/acceptance/test_cut_relay.py's set-up, with its helpers
(``ride_out_cuts``, tests/acceptance/cut_faults.py): a fresh database granted by
`outbox-relay grant`, two in-process relays as the relay role with the default
``session_timeout`` (10 s) and ``heartbeat_interval`` (2 s), a 4-part JSON subscriber,
writers as the writer role (4 events every 20 ms or so), and one fault: the first relay
cut by a black hole (sockets open, nothing flows; tests/black_hole.py) from

* ``kafka``: its own listener of a single-node Kafka, advertised at the black hole;
* ``postgres``: its database URL, through the black hole;
* ``both``: the two at once;

for 60 s (``OUTBOX_BENCH_CUT_S``), then healed. A ``read_committed`` consumer notes when
each part's records arrive; a part's stall is its longest time between two arrivals
from the cut until 15 s after the heal (the heal's handover back included), the
relay's parts and its peer's alike. The faults take turns, k p b k p b …, for 3 rounds
(``OUTBOX_BENCH_CUT_ROUNDS``; 5 at the default scale). Each figure is the median of the
rounds with its range; the target is issue #49's: no part stalls over 15 s. Each run's
record is also appended to bench/results/cut-runs.jsonl as it ends.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import psycopg

from bench.harness import RESULTS, SCHEMAS, Figure, Scale, Stack
from bench.method import Samples
from relay import Outbox
from relay.core.schemas import SchemaFolder
from relay.localstack import LocalKafka
from tests.acceptance.cluster_faults import PARTS, delivery_problems
from tests.acceptance.cut_faults import (
    FAULTS,
    Holes,
    kafka_with_cut_listener,
    postgres_hole,
    ride_out_cuts,
)
from tests.black_hole import BlackHole
from tests.support import grant_test_roles

TARGET_STALL_S = 15.0  # issue #49: session_timeout (10 s) and a takeover


def run(stack: Stack, scale: Scale) -> list[Figure]:
    rounds = int(os.environ.get("OUTBOX_BENCH_CUT_ROUNDS", "3" if scale.name == "quick" else "5"))
    cut_for = float(os.environ.get("OUTBOX_BENCH_CUT_S", "60"))
    faults = os.environ.get("OUTBOX_BENCH_CUT_FAULTS", ",".join(FAULTS)).split(",")
    registry = SchemaFolder.from_dir(SCHEMAS)
    runs: dict[str, list[dict[str, Any]]] = {fault: [] for fault in faults}
    stack.broker.stop()  # its JVM would take CPU from the cut one's
    try:
        with kafka_with_cut_listener(stack.workdir / "cut-kafka") as (kafka, kafka_hole):
            for round_ in range(rounds):
                for fault in faults:
                    record = _one(stack, kafka, kafka_hole, registry, fault, cut_for)
                    record["round"] = round_
                    _keep(record)
                    runs[fault].append(record)
    finally:
        stack.broker.start()
    return [f for fault, done in runs.items() for f in _figures(fault, done, cut_for)]


def _one(
    stack: Stack,
    kafka: LocalKafka,
    kafka_hole: BlackHole,
    registry: SchemaFolder,
    fault: str,
    cut_for: float,
) -> dict[str, Any]:
    """One run of ``fault`` on a new database; its record."""
    url, prefix, load_start = stack.fault_run("cut", fault)
    roles = grant_test_roles(url)
    with (
        psycopg.connect(roles.owner_url, autocommit=True) as owner,
        postgres_hole(roles.relay_url) as (pg_hole, cut_url),
    ):
        holes = Holes(kafka_hole, pg_hole, kafka_hole.address, cut_url)
        rides = ride_out_cuts(
            [fault],
            roles.relay_url,
            roles.writer_url,
            owner,
            Outbox(registry),
            registry,
            kafka,
            holes,
            prefix,
            cut_for=cut_for,
        )
        problems = delivery_problems(owner, kafka.bootstrap_servers, prefix + "outbox.event.order")
    [cut] = rides.cuts
    record = {
        "fault": fault,
        "cut_s": cut_for,
        "longest_gap_s": [round(cut.longest_gap[p], 2) for p in range(PARTS)],
        "longest_gap_while_cut_s": [round(cut.longest_gap_cut[p], 2) for p in range(PARTS)],
        "load_start": round(load_start, 2),
        "load_end": round(os.getloadavg()[0], 2),
        "events": rides.written,
        "delivery_problems": problems,
        "log": rides.log,
    }
    print(f"   {json.dumps(record)}", file=sys.stderr, flush=True)
    return record


def _keep(record: dict[str, Any]) -> None:
    """Append one run's record to bench/results/cut-runs.jsonl, so that a run cut short
    still leaves the rounds it finished."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "cut-runs.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")


def _figures(fault: str, runs: list[dict[str, Any]], cut_for: float) -> list[Figure]:
    if not runs:
        return []
    worst = [max(r["longest_gap_s"]) for r in runs]
    worst_cut = [max(r["longest_gap_while_cut_s"]) for r in runs]
    details = {"cut_s": cut_for, "runs": runs}
    target = f"value<={TARGET_STALL_S:g}"
    name = f"cut from {fault}: "
    return [
        Figure.of("cut", f"{name}longest stall, any part", Samples(tuple(worst)), "s",
                  target=target, details=details),
        Figure.of("cut", f"{name}longest stall while cut, any part", Samples(tuple(worst_cut)),
                  "s", target=target),
        Figure.of("cut", f"{name}runs with a stall over {TARGET_STALL_S:g} s",
                  Samples((float(sum(w > TARGET_STALL_S for w in worst)),)), "runs",
                  target="value<=0"),
        Figure.of("cut", f"{name}runs that lost or repeated an event",
                  Samples((float(sum(bool(r["delivery_problems"]) for r in runs)),)), "runs",
                  target="value<=0"),
    ]  # fmt: skip
