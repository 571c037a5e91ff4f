"""LISTEN for the outbox's commit hints and wake the workers.

NOTIFY is only a hint (it is lost while we are disconnected, and a commit that
releases the horizon without writing to the outbox sends none), so workers also poll
on a timer; this just makes the common case fast.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg

logger = logging.getLogger(__name__)

CHANNEL = "outbox_relay"


class NotifyListener(threading.Thread):
    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], schema: str, wake: Callable[[], None]
    ) -> None:
        super().__init__(name="outbox-notify", daemon=True)
        self._connect = connect
        self._schema = schema
        self._wake = wake
        self._stopping = threading.Event()
        self.connected = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            try:
                self._listen()
                delay = 0.5
            except Exception as exc:  # any failure: reconnect later; polling covers the gap
                self.connected.clear()
                logger.warning("notification listener: %s; reconnecting in %.1fs", exc, delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, 30.0)

    def _listen(self) -> None:
        with self._connect() as conn:
            conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(CHANNEL)))
            self.connected.set()
            self._wake()  # we may have missed hints while disconnected
            while not self._stopping.is_set():
                for notice in conn.notifies(timeout=0.5):
                    if notice.payload == self._schema:
                        self._wake()
