"""A micro-batch's rows on the driver a bounded slice at a time, not all at once.

``collect()`` brings a whole batch to the driver in one action: on a backlog that is
the driver's memory (and ``spark.driver.maxResultSize``, 1 GiB by default) against the
batch's size. :func:`local_rows` spreads the frame over partitions of a bounded number
of rows and reads them one partition at a time (``toLocalIterator``), so the driver holds
one partition; :func:`chunks` cuts that stream into the statements' chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import TypeVar

from pyspark.sql import DataFrame, Row

# The rows of a partition the driver reads at once. toLocalIterator ships a partition
# pickled (about 140 bytes an orders change: some 0.7 MB), and spark.driver.maxResultSize
# bounds each of its jobs, 1 GiB by default and never below 1 MiB: 5,000 fit that too.
ROWS_PER_PARTITION = 5_000

T = TypeVar("T")


def local_rows(frame: DataFrame, *order: str) -> Iterator[Row]:
    """``frame``'s rows, ``ROWS_PER_PARTITION`` or so at a time; in ``order`` (columns,
    ascending) over the whole frame when given: a range partitioning keeps the
    partitions' order, which ``toLocalIterator`` reads them in."""
    count = frame.count()
    if not count:
        return iter(())
    partitions = math.ceil(count / ROWS_PER_PARTITION)
    if not order:
        return frame.repartition(partitions).toLocalIterator()
    spread = frame.repartitionByRange(partitions, *order).sortWithinPartitions(*order)
    return spread.toLocalIterator()


def chunks(rows: Iterable[T], size: int) -> Iterator[list[T]]:
    """``rows`` in lists of ``size`` (the last one shorter)."""
    it = iter(rows)
    while chunk := list(islice(it, size)):
        yield chunk
