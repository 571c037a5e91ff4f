"""The Delta archive's reader: the rows of the table's current version, as delta-rs
reads them through the log (tables written here by delta-rs itself); its contract, and
verify's findings over it (a duplicate, a missing event, a foreign id)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from uuid import UUID, uuid4

import pytest

from relay.adapters.sinks.delta import DeltaReader
from relay.core.ports import SinkReader
from relay.errors import ConfigError, SinkUnreadable
from relay.ops.verify_sink import verify_sink
from tests.contracts.sink_reader import Batches, SinkReaderContract, SinkWith
from tests.unit.ops.test_verify_sink import Outbox, Store

deltalake = pytest.importorskip("deltalake")
pa = pytest.importorskip("pyarrow")


def commit(table: Path, rows: Sequence[tuple[UUID | None, str]], mode: str = "append") -> None:
    """One Delta commit of ``rows`` as the archive writes them (partitioned by date,
    other columns too)."""
    data = pa.table(
        {
            "topic": pa.array([t for _, t in rows], pa.string()),
            "offset": pa.array(range(len(rows)), pa.int64()),
            "message_id": pa.array([None if m is None else str(m) for m, _ in rows], pa.string()),
            "date": pa.array(["2026-12-03"] * len(rows), pa.string()),
        }
    )
    deltalake.write_deltalake(str(table), data, mode=mode, partition_by=["date"])


class TestDeltaReader(SinkReaderContract):
    @pytest.fixture
    def sink_with(self, tmp_path: Path) -> SinkWith:
        def written(batches: Batches) -> SinkReader:
            table = tmp_path / "table"
            commit(table, [])  # the table exists, empty or not
            for rows in batches:
                commit(table, rows)
            return DeltaReader(str(table))

        return written


def test_only_the_current_version_counts(tmp_path: Path) -> None:
    """Rows an overwrite removed are in an older version only: not read."""
    a, b = uuid4(), uuid4()
    commit(tmp_path, [(a, "t")])
    commit(tmp_path, [(b, "t")], mode="overwrite")
    assert list(DeltaReader(str(tmp_path)).message_ids()) == [(b, "t")]


def test_verify_finds_a_duplicate_a_missing_event_and_a_foreign_id(tmp_path: Path) -> None:
    a, b, c, foreign = uuid4(), uuid4(), uuid4(), uuid4()
    commit(tmp_path, [(a, "orders"), (b, "orders")])
    commit(tmp_path, [(b, "orders"), (foreign, "orders")])  # b again: a replayed batch
    outbox = Outbox([a, b, c], {})
    (report,) = verify_sink(Store(), outbox, DeltaReader(str(tmp_path)), "delta")  # type: ignore[arg-type]
    assert (report.expected, report.found, report.missing, report.twice) == (3, 2, 1, 1)
    assert report.not_in_outbox == 1
    assert report.examples == {
        "missing": [str(c)],
        "twice": [f"{b} (2 times)"],
        "not_in_outbox": [str(foreign)],
    }


def test_a_folder_without_a_delta_log_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Delta table"):
        DeltaReader(str(tmp_path))
    with pytest.raises(ConfigError, match="no such Delta table folder"):
        DeltaReader(str(tmp_path / "nowhere"))


def test_without_deltalake_it_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "deltalake", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"outbox-relay\[delta\]"):
        DeltaReader(str(tmp_path))


def test_a_damaged_log_is_unreadable(tmp_path: Path) -> None:
    commit(tmp_path, [(uuid4(), "t")])
    [first] = (tmp_path / "_delta_log").glob("*.json")
    first.write_text("{not json")
    with pytest.raises(SinkUnreadable, match="cannot read the Delta table"):
        list(DeltaReader(str(tmp_path)).message_ids())
