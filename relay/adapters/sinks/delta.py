"""The Delta archive (``spark_jobs.archive --output-format delta``) read back as every
Delta reader reads it: through the table's log, with the ``deltalake`` package.

Each batch of the archive is one Delta commit, so the table's current version holds
exactly the files of the committed batches: files a crashed write left behind are in
no commit and not read. The log is delta-rs's to interpret (checkpoints, removes,
deletion vectors), never parsed here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from uuid import UUID

from relay.adapters.sinks.rows import COLUMNS, message_rows
from relay.errors import ConfigError, SinkUnreadable


class DeltaReader:
    """The message ids of the current version of the Delta table at ``path`` (a local
    folder, or a URI delta-rs reads, with its credentials from the environment)."""

    def __init__(self, path: str) -> None:
        self._deltalake, self._path = _deltalake(), path
        if not urlparse(path).scheme and not Path(path).is_dir():
            raise ConfigError(f"{path}: no such Delta table folder")
        if not self._deltalake.DeltaTable.is_deltatable(path):
            raise ConfigError(f"{path}: not a Delta table (no _delta_log)")

    def message_ids(self) -> Iterator[tuple[UUID, str]]:
        # Opened here, not at construction: a damaged log is "could not check" (the
        # CLI's exit 3), not a usage error.
        errors = (OSError, ValueError, self._deltalake.exceptions.DeltaError)
        try:  # pyarrow's ArrowInvalid is a ValueError
            table = self._deltalake.DeltaTable(self._path).to_pyarrow_table(columns=COLUMNS)
        except errors as exc:
            raise SinkUnreadable(f"{self._path}: cannot read the Delta table: {exc}") from exc
        yield from message_rows(table, self._path)


def _deltalake() -> Any:
    try:
        import deltalake
        import deltalake.exceptions
        import pyarrow  # noqa: F401 (to_pyarrow_table's)
    except ImportError as exc:
        raise ConfigError(
            "reading a Delta table needs deltalake and pyarrow: pip install 'outbox-relay[delta]'"
        ) from exc
    return deltalake
