"""The archive's reader: the Parquet files Spark's ``_spark_metadata`` log lists (and
only those), or every file of a backfill's folder; its contract too."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from uuid import UUID, uuid4

import pytest

from relay.adapters.sinks.archive import ArchiveReader, committed_entries
from relay.core.ports import SinkReader
from relay.errors import ConfigError, SinkUnreadable
from tests.contracts.sink_reader import Batches, SinkReaderContract, SinkWith

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


def parquet(folder: Path, name: str, rows: Sequence[tuple[UUID | None, str]]) -> Path:
    """A file as the archive writes it (under a date= folder, other columns too)."""
    path = folder / "date=2026-12-03" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "topic": [t for _, t in rows],
            "offset": list(range(len(rows))),
            "message_id": [None if m is None else str(m) for m, _ in rows],
        }
    )
    pq.write_table(table, path)
    return path


def log(folder: Path, batch: str, adds: Sequence[Path], deletes: Sequence[Path] = ()) -> None:
    """A batch of the file sink's log: v1, then an action per line."""
    meta = folder / "_spark_metadata"
    meta.mkdir(parents=True, exist_ok=True)
    lines = ["v1"]
    for action, paths in (("add", adds), ("delete", deletes)):
        for p in paths:
            entry = {"path": p.as_uri(), "size": 1, "isDir": False, "action": action}
            lines.append(json.dumps(entry))
    (meta / batch).write_text("\n".join(lines))


class TestArchiveReader(SinkReaderContract):
    @pytest.fixture
    def sink_with(self, tmp_path: Path) -> SinkWith:
        def written(batches: Batches) -> SinkReader:
            for n, rows in enumerate(batches):
                log(tmp_path, str(n), [parquet(tmp_path, f"part-{n}.parquet", rows)])
            return ArchiveReader(str(tmp_path))

        return written


def test_files_its_log_does_not_list_are_leftovers_and_ignored(tmp_path: Path) -> None:
    a = uuid4()
    log(tmp_path, "0", [parquet(tmp_path, "part-0.parquet", [(a, "t")])])
    parquet(tmp_path, "part-crashed.parquet", [(a, "t"), (uuid4(), "t")])  # no log entry
    assert list(ArchiveReader(str(tmp_path)).message_ids()) == [(a, "t")]


def test_the_last_compact_batch_holds_all_before_it(tmp_path: Path) -> None:
    files = [tmp_path / f"f{n}.parquet" for n in range(4)]
    log(tmp_path, "0", files[:1])  # compacted since: not read again
    log(tmp_path, "1", files[1:2])
    log(tmp_path, "1.compact", files[:2])
    log(tmp_path, "2", files[2:4], deletes=files[:1])
    (tmp_path / "_spark_metadata" / ".2.crc").write_text("x")  # Spark's checksums
    assert committed_entries(tmp_path / "_spark_metadata") == [f.as_uri() for f in files[1:]]


def test_a_backfill_without_a_log_counts_every_parquet_file_but_hidden_ones(
    tmp_path: Path,
) -> None:
    a, b = uuid4(), uuid4()
    parquet(tmp_path, "part-0.parquet", [(a, "t")])
    parquet(tmp_path, "part-1.parquet", [(b, "t")])
    parquet(tmp_path / "_temporary", "part-2.parquet", [(uuid4(), "t")])
    assert sorted(ArchiveReader(str(tmp_path)).message_ids()) == sorted([(a, "t"), (b, "t")])


def test_a_listed_file_that_is_gone_is_unreadable(tmp_path: Path) -> None:
    log(tmp_path, "0", [tmp_path / "gone.parquet"])
    with pytest.raises(SinkUnreadable, match="missing"):
        list(ArchiveReader(str(tmp_path)).message_ids())


def test_a_log_that_is_not_spark_s_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "_spark_metadata").mkdir()
    (tmp_path / "_spark_metadata" / "0").write_text("v9\n{}")
    with pytest.raises(SinkUnreadable, match="not a Spark file sink log"):
        list(ArchiveReader(str(tmp_path)).message_ids())


def test_no_folder_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such archive folder"):
        ArchiveReader(str(tmp_path / "nowhere"))


def test_without_pyarrow_it_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"outbox-relay\[spark\]"):
        ArchiveReader(str(tmp_path))
