"""The sink reader's contract (tests/contracts/sink_reader.py) held against the
in-memory sink."""

from __future__ import annotations

import pytest

from relay.adapters.memory import InMemorySink
from relay.core.ports import SinkReader
from tests.contracts.sink_reader import Batches, SinkReaderContract, SinkWith


class TestInMemorySink(SinkReaderContract):
    @pytest.fixture
    def sink_with(self) -> SinkWith:
        def written(batches: Batches) -> SinkReader:
            sink = InMemorySink()
            for rows in batches:
                sink.write(rows)
            return sink

        return written
