"""One local Spark session for the whole test session (skipped without pyspark)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every Spark test (starting one takes seconds)."""
    pytest.importorskip("pyspark")
    from spark_jobs.spark_session import local_spark_session

    session = local_spark_session("outbox-relay-tests")
    yield session
    session.stop()
    # py4j logs from connection finalizers at interpreter exit, after pytest has closed
    # the streams its handlers write to: a "Logging error" traceback under a green run.
    logging.getLogger("py4j").setLevel(logging.WARNING)
