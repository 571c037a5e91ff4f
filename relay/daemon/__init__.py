"""The relay daemon: claims subscriber parts and runs one worker per claimed part.

Several relay processes may run against one database. Each holds a session
(:mod:`relay.engine.sessions`); a supervisor thread spreads the parts over the live
sessions, claims its share, releases what a peer should own, and starts or stops
workers to match. The commit probe wakes the workers; they also poll on a timer.

:class:`Relay` (``lifecycle``) composes one object per concern: ``membership`` (the
session, held while Kafka answers), ``parts`` (claims and their workers, each with a
Kafka publisher from :mod:`relay.adapters.kafka.publishers`), ``upkeep`` (retention
and horizon warnings), ``startup`` (schema check, key-space checks) and ``metrics``
(the health and metrics servers, on ``listener``); its subscribers are
defined, checked and written by :func:`relay.ops.subscribers.sync`, as `subscribers add`
defines them.
:class:`RelayProcesses` (``processes``) runs several of them as member processes.

The package imports them when first asked for (PEP 562): ``lifecycle`` wires the
Postgres adapters in, and importing one of the modules behind the ports
(``relay.daemon.parts``, ...) runs this file first, so an import here would bring the
database client along (tests/unit/test_layers.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.daemon.lifecycle import Relay, start_with_retries, tune_gc, tune_process
    from relay.daemon.processes import RelayProcesses

__all__ = ["Relay", "RelayProcesses", "start_with_retries", "tune_gc", "tune_process"]

_HOME = {
    "Relay": "lifecycle",
    "start_with_retries": "lifecycle",
    "tune_gc": "lifecycle",
    "tune_process": "lifecycle",
    "RelayProcesses": "processes",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
