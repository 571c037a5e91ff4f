"""What every part of the daemon shares: its settings, its way to the database, and the
flag that says the relay is stopping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from relay.core.ports import DaemonStore
from relay.core.settings import Settings


@dataclass(frozen=True)
class DaemonContext:
    settings: Settings
    # The daemon's way to the database: its store port (Postgres: relay.adapters.postgres.store, pooled).
    open_store: Callable[[], DaemonStore]
    stopping: threading.Event
