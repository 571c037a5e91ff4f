"""A TCP proxy that can turn into a black hole: the network cut of issue #49.

While cut, it forwards nothing either way, yet every socket stays open and new
connections are accepted: a client sees no error, only silence, as behind a firewall that
drops packets. What either side sent meanwhile is held (in the proxy and the kernels'
buffers) and delivered once the proxy heals, late, as a network that comes back delivers
what it queued. A client pointed at :attr:`BlackHole.address` goes through it; the
others reach the server directly.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_CHUNK = 65536
_POLL_S = 0.2  # how often an idle pump looks whether the proxy is closing


class BlackHole:
    """Forwards 127.0.0.1:``port`` (a free port unless given) to ``target``; :meth:`cut`
    stops the traffic without closing anything, :meth:`heal` lets it flow again."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="black-hole-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        """Close every connection and the listener (a test's end, not a fault)."""
        self._closed.set()
        self._flowing.set()  # pumps held by a cut see the close
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            # A connection opened during a cut is accepted (the client sees no refusal)
            # and joined to the server only once the cut heals.
            threading.Thread(
                target=self._join, args=(client,), name="black-hole-pump", daemon=True
            ).start()

    def _join(self, client: socket.socket) -> None:
        self._keep(client)
        self._flowing.wait()
        try:
            server = socket.create_connection(self._target, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self._keep(server)
        back = threading.Thread(
            target=self._pump, args=(server, client), name="black-hole-pump", daemon=True
        )
        back.start()
        self._pump(client, server)
        back.join()
        # Both ways ended: closed here, so a proxy that outlives many clients (a
        # benchmark's rounds) holds no descriptor of theirs.
        with self._lock:
            self._sockets = [s for s in self._sockets if s not in (client, server)]
        client.close()
        server.close()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        poller = select.poll()  # not select(): descriptors above 1024 are common here
        poller.register(source, select.POLLIN)
        try:
            while not self._closed.is_set():
                self._flowing.wait()
                if not poller.poll(_POLL_S * 1000):
                    continue
                data = source.recv(_CHUNK)
                if not data:
                    break
                self._flowing.wait()  # read as the cut began: held until it heals
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
