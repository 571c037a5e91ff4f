"""A real schema registry for the session (``schema_registry``): the Confluent-compatible
API of Apicurio Registry, built once from Maven Central and started as a local process
(:mod:`relay.localstack.registry`), or an external one named by
``OUTBOX_TEST_SCHEMA_REGISTRY_URL`` (any Confluent Schema Registry compatible URL).

The registry keeps its schemas in memory: it starts empty each session, and tests name
their own subjects (``topic_prefix``) because the session shares it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest

from relay.localstack.registry import LocalRegistry

_log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of the session's schema registry, as ``schema.registry.url`` takes it."""
    external = os.environ.get("OUTBOX_TEST_SCHEMA_REGISTRY_URL")
    if external:
        yield external
        return
    registry = LocalRegistry(tmp_path_factory.mktemp("registry"))
    started = time.monotonic()
    with registry:
        _log.info("Apicurio Registry started in %.1fs", time.monotonic() - started)
        yield registry.ccompat_url
