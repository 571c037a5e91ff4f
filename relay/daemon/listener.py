"""One HTTP listener of the relay (relay/daemon/metrics.py serves two: the
metrics port and the probe port), on waitress, guarded against clients that hold
connections open without finishing a request (slowloris).

waitress alone closes a connection only after CLIENT_TIMEOUT_S of *silence*: clients
that each sent a header line every 4 s kept their connections for ever, 100 of them
filled the connection limit, and the kubelet's probes waited in the listen backlog
until they timed out (issue #47), which restarts every replica at once. So, on top of
waitress (its hooks: the channel class, ``maintenance``, the accepted channel):

* **A deadline on the request's headers.** A connection waiting for a request (none
  received yet, or none since its last response) is closed HEADER_DEADLINE_S after it
  began waiting, however much it sends meanwhile. Bodies are refused from their headers
  (413), so a request received is complete.
* **A cap per peer address.** One address holds at most PER_PEER connections: a new one
  beyond that closes the one of that address that has waited longest for its request.
* **New connections are taken, slow ones make room.** Past MAX_CONNECTIONS, a new
  connection closes the one of any address that has waited longest; only when none is
  waiting (every one has a request being answered) is the new one closed instead.

A probe sends its request with its connection, so it is answered before it could be
the one that waited longest: no number of slow clients, from one address or many, keeps
a probe out. Requests being answered are never cut. What is closed, and why, is counted
(:attr:`Listener.dropped`, ``outbox_relay_http_connections_dropped_total``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from waitress.adjustments import Adjustments  # type: ignore[import-untyped]
from waitress.channel import HTTPChannel  # type: ignore[import-untyped]
from waitress.server import TcpWSGIServer  # type: ignore[import-untyped]

from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

# From accept, or from the end of the last response, to the end of the next request's
# headers. Probes and scrapes send theirs at once; a keep-alive connection idle for this
# long is closed too (clients reconnect).
HEADER_DEADLINE_S = 5.0
PER_PEER = 16  # the kubelet's probes and a Prometheus, even behind one proxy, need a few
MAX_CONNECTIONS = 100
# Silence while a response is still being sent (a client that does not read it).
CLIENT_TIMEOUT_S = 10
# No endpoint takes a body: one is refused (413) from its headers, before waitress would
# read it, and so spool it to a temporary file. Headers stay small too.
MAX_BODY_BYTES = 0
MAX_HEADER_BYTES = 16 * 1024

WsgiApp = Callable[[dict[str, Any], Any], Iterable[bytes]]


class _Channel(HTTPChannel):  # type: ignore[misc]
    """A connection that knows since when it has waited for a request."""

    def __init__(self, server: _Server, sock: Any, addr: Any, adj: Any, map: Any = None) -> None:
        super().__init__(server, sock, addr, adj, map=map)
        self.waiting_since: float = self.creation_time
        self.serving = False  # set by the task thread while it answers
        server.admit(self)

    def service(self) -> None:
        # Flagged before waitress pops the request it answers, so the I/O thread never
        # sees it waiting with the time it began waiting for that request.
        self.serving = True
        try:
            super().service()
        finally:
            self.waiting_since = time.time()
            self.serving = False

    def waiting(self) -> bool:
        """Waiting for a request: nothing to answer, nothing left to send, not closing."""
        return not (
            self.serving
            or self.requests
            or self.total_outbufs_len
            or self.will_close
            or self.close_when_flushed
        )

    def closing(self) -> bool:
        return bool(self.will_close or self.close_when_flushed)


class _Server(TcpWSGIServer):  # type: ignore[misc]
    channel_class = _Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.dropped: Counter[str] = Counter()
        super().__init__(*args, **kwargs)

    def admit(self, new: _Channel) -> None:
        """Make room for a connection just accepted (in the I/O thread)."""
        others = [c for c in self.active_channels.values() if c is not new and not c.closing()]
        peer = [c for c in others if c.addr[0] == new.addr[0]]
        if len(peer) >= PER_PEER:
            self._close_longest_waiting(peer, new, "peer_limit")
        elif len(others) >= MAX_CONNECTIONS:
            self._close_longest_waiting(others, new, "connection_limit")

    def _close_longest_waiting(self, among: list[_Channel], new: _Channel, reason: str) -> None:
        waiting = [c for c in among if c.waiting()]
        victim = min(waiting, key=lambda c: c.waiting_since) if waiting else new
        victim.will_close = True
        self.dropped[reason] += 1

    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # CLIENT_TIMEOUT_S of silence
        cutoff = now - HEADER_DEADLINE_S
        for channel in list(self.active_channels.values()):
            if channel.waiting() and channel.waiting_since < cutoff:
                channel.will_close = True
                self.dropped["header_deadline"] += 1


class Listener:
    """One port, its I/O thread, and the task dispatcher its requests go to."""

    def __init__(self, name: str, app: WsgiApp, host: str, port: int, dispatcher: Any) -> None:
        adj = Adjustments(
            host=host,
            port=port,
            # waitress's own limit stops accepting (new connections wait in the listen
            # backlog): only a backstop here, above the one _Server.admit keeps.
            connection_limit=2 * MAX_CONNECTIONS,
            channel_timeout=CLIENT_TIMEOUT_S,
            cleanup_interval=1,
            max_request_body_size=MAX_BODY_BYTES,
            max_request_header_size=MAX_HEADER_BYTES,
            ident="outbox-relay",
            clear_untrusted_proxy_headers=True,
            # poll(), not select(): select() fails on descriptors above 1023, and a
            # relay of 100 parts holds more than that (a connection and a producer's
            # sockets each), which would stop the endpoints.
            asyncore_use_poll=True,
        )
        # The first address the host resolves to (waitress would open one server per
        # address; the relay's hosts are addresses).
        self._server = _Server(app, {}, dispatcher=dispatcher, adj=adj, sockinfo=adj.listen[0])
        self.port = int(self._server.effective_port)
        self._thread = threading.Thread(
            target=self._server.run, name=f"relay-http-{name}", daemon=True
        )

    @property
    def dropped(self) -> Counter[str]:
        """Connections closed to make room or past the deadline, by reason."""
        return self._server.dropped

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.ident is None:
            # Never started (the probe port refused once the metrics port was open): no
            # loop to close the sockets from, nor a thread to wait for.
            self._close_all()
            self._server.task_dispatcher.shutdown(timeout=5)
            return
        # Close every socket from the I/O thread itself (a trigger runs it there), so
        # its poll never sees a descriptor closed underneath it; then its loop ends.
        if not self._run_in_loop(self._close_all):
            # Nothing can wake the loop: close from here. Each socket leaves the loop's
            # map as it closes, so the loop ignores what poll says of it, then ends.
            self._close_all()
        self._thread.join(5.0)
        self._server.task_dispatcher.shutdown(timeout=5)

    def _run_in_loop(self, thunk: Callable[[], None]) -> bool:
        """Have the I/O thread run ``thunk``; False when its wake-up pipe is gone.

        waitress's loop closes that pipe itself when poll() reports it hung up or
        invalid, and writing to its old number then fails (or, were the number reused,
        would write into someone else's file), so a closed one is never written to."""
        trigger = self._server.trigger
        try:
            if not trigger._closed:
                trigger.pull_trigger(thunk)
                return True
            error = "closed by the server's loop"
        except OSError as exc:
            error = exc.strerror or str(exc)
        logger.warning(
            "the HTTP server's wake-up pipe is gone (%s): closing its sockets from here",
            error,
            extra=log_extra("http_wakeup_lost", error=error),
        )
        return False

    def _close_all(self) -> None:
        for dispatcher in list(self._server._map.values()):
            dispatcher.close()
