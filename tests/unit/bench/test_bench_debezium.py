"""The Debezium comparison's instrument (bench/debezium.py): the tally that checks every
record arrived exactly once, the window a rate is taken over, and the GC log's pauses.
No figure is measured here (performance lives in bench/)."""

from __future__ import annotations

import math
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from bench import debezium as debezium_bench
from bench import latency
from bench.debezium import (
    DEBEZIUM,
    EXACTLY_ONCE,
    FLOOR_IDEMPOTENT,
    FLOOR_TRANSACTIONAL,
    IDEMPOTENT,
    RELAY_SIDES,
    SIDE_KEYS,
    WORKERS_EXACTLY_ONCE,
    Span,
    Tally,
    _latency_figures,
    _suspended,
    chosen_sides,
    gc_pauses,
    jvm_options,
)
from bench.harness import Scale

IDS = [str(uuid.uuid4()) for _ in range(5)]


def test_a_tally_of_every_record_once_matches_the_rows_written() -> None:
    written = Tally.of(IDS)
    Tally.of(reversed(IDS)).check(written, "topic")  # any order


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        (IDS[:-1], "some lost or duplicated"),  # one lost
        ([*IDS, IDS[0]], "some lost or duplicated"),  # one twice
        ([*IDS[:-1], IDS[0]], "some lost and as many duplicated"),  # one lost, one twice
    ],
)
def test_a_tally_with_a_record_lost_or_twice_fails(seen: list[str], why: str) -> None:
    with pytest.raises(RuntimeError, match=why):
        Tally.of(seen).check(Tally.of(IDS), "topic")


def test_the_rate_leaves_the_warm_up_out_and_ends_at_the_expected_count() -> None:
    # (time, records so far): 100 warm-up records by t=1, 300 more by t=3; then 5
    # records arrive late (a duplicate check's extra second), outside the window.
    points = [(0.5, 40), (1.0, 100), (2.0, 250), (3.0, 400), (4.0, 405)]
    span = Span.upto(points, 400)
    assert span.points[-1] == (3.0, 400)
    assert span.ev_s(100) == 300 / 2.0  # from the batch that completed the warm-up
    assert span.ev_s(0) == 360 / 2.5  # from the first batch, whose records are left out


def test_gc_pauses_are_read_from_a_unified_gc_log() -> None:
    log = (
        "[0.006s][info][gc] Using G1\n"
        "[0.120s][info][gc,start    ] GC(0) Pause Young (Normal) (G1 Evacuation Pause)\n"
        "[0.123s][info][gc,phases   ] GC(0)   Other: 0.1ms\n"
        "[0.123s][info][gc          ] GC(0) Pause Young (Normal) (G1 Evacuation Pause)"
        " 51M->3M(1024M) 2.500ms\n"
        "[9.000s][info][gc          ] GC(1) Pause Remark 40M->40M(1024M) 1.250ms\n"
    )
    assert gc_pauses(log) == {"gc_pauses": 2, "gc_pause_ms": 3.8, "gc_max_pause_ms": 2.5}
    assert gc_pauses("") == {"gc_pauses": 0, "gc_pause_ms": 0.0, "gc_max_pause_ms": 0.0}


def test_the_jvm_heap_is_fixed_at_a_gibibyte_and_its_gc_logged() -> None:
    options = jvm_options(Path("/x/gc.log"))
    assert "-Xms1g" in options and "-Xmx1g" in options
    assert any(o.startswith("-Xlog:gc*:file=/x/gc.log") for o in options)


def test_a_rate_over_a_single_batch_is_not_a_number() -> None:
    assert math.isnan(Span.upto([(1.0, 1)], 1).ev_s(0))


def test_the_connect_peer_takes_debezium_servers_source_and_producer_settings() -> None:
    from bench.connect import connector_config, worker_config

    server = {
        "debezium.source.connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "debezium.source.max.batch.size": "4096",
        "debezium.source.offset.storage.file.filename": "/x/offsets.dat",
        "debezium.transforms": "outbox",
        "debezium.transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "debezium.sink.kafka.producer.linger.ms": "5",
        "debezium.sink.kafka.producer.bootstrap.servers": "elsewhere:9092",
        "debezium.sink.kafka.producer.key.serializer": "StringSerializer",
        "debezium.format.value": "simplestring",
    }
    connector = connector_config(server)
    assert connector["max.batch.size"] == "4096"
    assert connector["transforms.outbox.type"].endswith("EventRouter")
    # Exactly once, a transaction per poll; nothing of the server's own storage or sink.
    assert connector["exactly.once.support"] == "required"
    assert connector["transaction.boundary"] == "poll"
    assert not any("offset.storage" in k or k.startswith(("sink", "format")) for k in connector)
    worker = worker_config("127.0.0.1:9092", "g", 8083, server)
    assert worker["exactly.once.source.support"] == "enabled"
    assert worker["bootstrap.servers"] == "127.0.0.1:9092" and worker["producer.linger.ms"] == "5"
    assert not any(k.startswith("producer.") and "serializer" in k for k in worker)
    assert "producer.bootstrap.servers" not in worker


@pytest.mark.parametrize("unset", [None, "", " , "])
def test_every_side_runs_when_none_is_chosen(unset: str | None) -> None:
    assert chosen_sides(unset) == frozenset(SIDE_KEYS.values())


def test_a_subset_of_sides_always_keeps_debezium_server_which_writes_the_rows() -> None:
    chosen = chosen_sides(" exactly-once,workers ")
    assert chosen == {DEBEZIUM, EXACTLY_ONCE, WORKERS_EXACTLY_ONCE}
    assert "latency" not in chosen  # the latency rounds run only when named


def test_an_unknown_side_is_refused_with_the_names_to_choose_from() -> None:
    with pytest.raises(ValueError, match="unknown \\['worker'\\]; choose from"):
        chosen_sides("exactly-once,worker")


def test_the_two_worker_side_is_exactly_once_with_a_part_per_worker() -> None:
    side = RELAY_SIDES[WORKERS_EXACTLY_ONCE]
    assert side.delivery == "transactional"
    assert side.workers == 2 and side.parts >= side.workers
    assert RELAY_SIDES[EXACTLY_ONCE].workers == 1  # the 1-process figure is kept


def test_each_round_writes_its_rows_once_whichever_side_runs_first() -> None:
    from bench.debezium import CONNECT, _Backlog

    backlog = _Backlog.__new__(_Backlog)  # no stack: only the round bookkeeping
    backlog.rounds, backlog.filled = {}, 0
    refills: list[int] = []
    backlog._refill = lambda: refills.append(backlog.filled)  # type: ignore[method-assign]
    sides = [DEBEZIUM, CONNECT, EXACTLY_ONCE]
    first = []
    for round_ in range(3):  # A B C, C B A, A B C: as bench.method.interleave runs them
        for name in sides if round_ % 2 == 0 else sides[::-1]:
            before = len(refills)
            backlog._round_rows(name)
            if len(refills) > before:
                first.append(name)
            backlog.rounds.setdefault(name, []).append({})
    assert refills == [0, 1, 2]  # once a round
    assert first == [DEBEZIUM, EXACTLY_ONCE, DEBEZIUM]  # by the first side to run in it


def _run(ms: float) -> latency.Samples:
    return latency.Samples([ms / 1000] * 10, 10, 1.0, 1.0)


def test_the_latency_figures_set_each_relay_mode_and_debezium_against_the_brokers_floors() -> None:
    """The floors say how far a target is reachable: a relay's latency is its floor's
    plus its own work, so each is set against Debezium's p50 and under its relay mode."""
    runs = {DEBEZIUM: [_run(2.0)], EXACTLY_ONCE: [_run(12.0)], IDEMPOTENT: [_run(3.0)],
            FLOOR_IDEMPOTENT: [_run(0.4)], FLOOR_TRANSACTIONAL: [_run(5.0)]}  # fmt: skip
    ratios = {f.name: f.value / f.baseline for f in _latency_figures(runs, Scale.named("quick"))}
    assert ratios[f"commit to visible p50, {FLOOR_TRANSACTIONAL} vs Debezium"] == 2.5
    assert ratios[f"commit to visible p50, {FLOOR_IDEMPOTENT} vs Debezium"] == 0.2
    assert ratios[f"commit to visible p50, {EXACTLY_ONCE} vs its floor in this run"] == 2.4
    assert ratios[f"commit to visible p50, {IDEMPOTENT} vs its floor in this run"] == 7.5
    assert ratios[f"commit to visible p50, {EXACTLY_ONCE} vs Debezium"] == 6.0


class _Process:
    """What _suspended reads of a LocalDebeziumServer, over any child process."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.pid: int | None = proc.pid
        self._proc = proc
        self.log_path = Path("/dev/null")

    @property
    def running(self) -> bool:
        return self._proc.poll() is None


def _state(pid: int, *, becomes: str) -> str:
    """The process's state once it is ``becomes`` (a signal takes effect a moment
    later), or as it is after a few seconds: /proc/<pid>/stat's "pid (comm) state"."""
    for _ in range(500):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in becomes:
            break
        time.sleep(0.01)
    return state


def test_debezium_server_is_suspended_while_another_side_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(debezium_bench, "RESUMED_S", 0.0)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with _suspended(_Process(proc)):  # type: ignore[arg-type]
            assert _state(proc.pid, becomes="T") == "T"  # stopped by a signal
        assert _state(proc.pid, becomes="SR") in "SR"
    finally:
        proc.kill()
        proc.wait()


def test_a_debezium_server_that_died_while_suspended_fails_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(debezium_bench, "RESUMED_S", 0.0)
    proc = subprocess.Popen(["sleep", "60"])
    with pytest.raises(RuntimeError, match="exited"), _suspended(_Process(proc)):  # type: ignore[arg-type]
        proc.kill()
        proc.wait()
