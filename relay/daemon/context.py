"""What every part of the daemon shares: its settings, its way to the database, and the
flag that says the relay is stopping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from relay.settings import Settings
from relay.store import OutboxStore


@dataclass(frozen=True)
class DaemonContext:
    settings: Settings
    open_store: Callable[[], OutboxStore]
    stopping: threading.Event
