"""The Spark archive (``spark_jobs/archive.py``) read back as its readers should.

Spark's file sink lists the files of each committed batch in ``PATH/_spark_metadata``
(``N`` and, every few batches, ``N.compact`` holding all before it): a file it does not
list is a leftover of a crashed batch, with rows a committed batch wrote again. So only
the listed files count, which is what makes the archive exactly once (for readers that
honour the log). A backfill's folder has no log: every Parquet file counts there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse
from uuid import UUID

from relay.adapters.sinks.rows import COLUMNS, message_rows
from relay.errors import ConfigError, SinkUnreadable

_LOG = "_spark_metadata"


class ArchiveReader:
    """The message ids of the archive at ``path`` (a local folder)."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        if not self._path.is_dir():
            raise ConfigError(f"{path}: no such archive folder")
        self._parquet = _pyarrow_parquet()

    def message_ids(self) -> Iterator[tuple[UUID, str]]:
        for file in self.files():
            try:
                table = self._parquet.ParquetFile(file).read(columns=COLUMNS)
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise SinkUnreadable(f"{file}: cannot read its rows: {exc}") from exc
            yield from message_rows(table, file)

    def files(self) -> list[Path]:
        """The archive's committed files: those its log lists, or (a backfill, no log)
        every Parquet file but Spark's hidden ones."""
        log = self._path / _LOG
        if not log.is_dir():
            return sorted(
                p
                for p in self._path.rglob("*.parquet")
                if not any(part.startswith(("_", ".")) for part in p.relative_to(self._path).parts)
            )
        return [_local(entry) for entry in committed_entries(log)]


def committed_entries(log: Path) -> list[str]:
    """The paths the file sink's log adds and does not delete, in batch order: the last
    compact batch's file, then every batch after it."""
    batches: dict[int, Path] = {}
    for entry in log.iterdir():
        name = entry.name.removesuffix(".compact")
        if name.isdigit():  # not Spark's .crc or temporary files
            batches[int(name)] = entry
    compact = [n for n, p in batches.items() if p.name.endswith(".compact")]
    first = max(compact, default=min(batches, default=0))
    paths: dict[str, None] = {}
    for number in sorted(n for n in batches if n >= first):
        for action in _actions(batches[number]):
            if action.get("action") == "delete":
                paths.pop(action["path"], None)
            else:
                paths[action["path"]] = None
    return list(paths)


def _actions(batch: Path) -> list[dict[str, Any]]:
    lines = batch.read_text().splitlines()
    if not lines or lines[0] != "v1":
        raise SinkUnreadable(f"{batch}: not a Spark file sink log (its first line is not v1)")
    try:
        return [json.loads(line) for line in lines[1:] if line.strip()]
    except json.JSONDecodeError as exc:
        raise SinkUnreadable(f"{batch}: damaged log entry: {exc}") from exc


def _local(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise SinkUnreadable(f"{uri}: only archives on a local (or mounted) file system are read")
    path = Path(unquote(parsed.path))
    if not path.is_file():
        raise SinkUnreadable(f"{path}: listed in the archive's {_LOG} but missing")
    return path


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError(
            "reading the archive needs pyarrow: pip install 'outbox-relay[spark]'"
        ) from exc
    return pyarrow.parquet
