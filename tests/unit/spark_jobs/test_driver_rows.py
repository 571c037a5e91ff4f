"""Issue #51: the statements' chunks of a batch's rows, read a partition at a time."""

from __future__ import annotations

from spark_jobs.driver_rows import chunks


def test_rows_come_in_chunks_of_the_size_in_their_order_the_last_shorter() -> None:
    assert list(chunks(iter(range(7)), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(chunks([], 3)) == []
