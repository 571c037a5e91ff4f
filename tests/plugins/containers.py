"""Whether a Docker engine answers: the real-server plugins then use testcontainers."""

from __future__ import annotations

import functools
import logging

_log = logging.getLogger(__name__)


@functools.cache
def docker_available() -> bool:
    """True when a Docker engine answers a ping (checked once, quickly)."""
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:
        _log.debug("no Docker engine: %s", exc)
        return False
