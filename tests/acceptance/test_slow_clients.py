"""Issue #47, medium 1: probes keep answering while clients hold the relay's HTTP
connections. 100 connections that each sent a header line every 4 s kept /healthz from
answering for as long as they lasted (waitress times out silence, not slowness), and the
liveness probe would then restart every replica. Each probe here gets the kubelet's own
5 s timeout; nothing else is timed."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from relay.daemon import Relay
from tests.support import http_get, sub, wait_until

SLOW = 100
LINE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 5.0  # the kubelet's timeoutSeconds in deploy/k8s/deployment.yaml


class _Slowloris:
    """Clients that each send a request line, then a header line every LINE_EVERY_S,
    and never end their headers; from ``sources`` in turn (127.0.0.x: Linux routes all of
    127/8 to loopback)."""

    def __init__(
        self, port: int, sources: list[str], count: int, request: bytes, trickle: bool = True
    ) -> None:
        self.clients: list[socket.socket] = []
        for i in range(count):
            client = socket.socket()
            client.bind((sources[i % len(sources)], 0))
            client.settimeout(10)
            client.connect(("127.0.0.1", port))
            client.sendall(request)
            self.clients.append(client)
        self.closed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        if trickle:
            self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(LINE_EVERY_S):
            for i, client in enumerate(self.clients):
                if i not in self.closed:
                    try:
                        client.sendall(b"X-Slow: 1\r\n")
                    except OSError:
                        self.closed.add(i)

    def all_closed_by_the_server(self) -> bool:
        """Whether the server closed every connection (end of stream, or a reset)."""
        for i, client in enumerate(self.clients):
            if i in self.closed or not select.select([client], [], [], 0)[0]:
                continue
            try:
                if client.recv(4096) == b"":
                    self.closed.add(i)
            except OSError:
                self.closed.add(i)
        return len(self.closed) == len(self.clients)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for client in self.clients:
            client.close()


@contextmanager
def _slowloris(port: int, sources: list[str], count: int = SLOW) -> Iterator[_Slowloris]:
    attack = _Slowloris(port, sources, count, b"GET /healthz HTTP/1.1\r\nHost: relay\r\n")
    try:
        yield attack
    finally:
        attack.stop()


def _probes_answer(relay: Relay) -> bool:
    """/healthz and /readyz on the probe port and on the metrics port (older manifests
    probe that one), each within the kubelet's timeout; an error or a timeout fails."""
    assert relay.http is not None
    for port in (relay.http.probe_port, relay.http.port):
        base = f"http://127.0.0.1:{port}"
        assert http_get(base + "/healthz", timeout=PROBE_TIMEOUT_S) == (200, "ok")
        assert http_get(base + "/readyz", timeout=PROBE_TIMEOUT_S)[0] == 200
    return True


def _ready(relay: Relay) -> Relay:
    wait_until(lambda: relay.ready()[0], what="the relay to be ready")
    return relay


@pytest.mark.parametrize("attacked", ["probes", "metrics"])
@pytest.mark.parametrize(
    "sources",
    [["127.0.0.1"], [f"127.0.0.{i}" for i in range(2, 52)]],
    ids=["one-address", "50-addresses"],
)
def test_probes_answer_while_slow_clients_hold_connections_and_those_are_closed(
    attacked: str, sources: list[str], topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    relay = _ready(start_relay(subscribers=[sub("s", topic_prefix)]))
    assert relay.http is not None
    port = relay.http.probe_port if attacked == "probes" else relay.http.port
    # From 50 addresses: 150 connections, more than the server keeps open at once.
    count = SLOW if len(sources) == 1 else 3 * len(sources)
    with _slowloris(port, sources, count) as attack:
        # The probes answer for as long as the attack lasts; the server closes every slow
        # connection (past the deadline on headers, or to make room), however much it
        # trickles.
        wait_until(
            lambda: _probes_answer(relay) and attack.all_closed_by_the_server(),
            what="the server to close every slow connection",
        )
    assert _probes_answer(relay)
    listener = relay.http.probe_listener if attacked == "probes" else relay.http.listener
    assert sum(listener.dropped.values()) >= count, listener.dropped


def test_scrapes_cannot_use_up_the_probe_port(
    database_url: str, topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    """Scrapes stuck behind a table lock (each waits for the read of Postgres) hold the
    metrics port's connections, all of them, with complete requests: the probe port is
    another listener, which serves nothing else."""
    relay = _ready(start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0))
    assert relay.http is not None
    scrape = b"GET /metrics HTTP/1.1\r\nHost: relay\r\n\r\n"
    sources = [f"127.0.0.{i}" for i in range(2, 10)]  # 15 each: under the cap per address
    with psycopg.connect(database_url) as locker:
        # The owner: a lock no other role of the tests may take on the outbox.
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        scrapes = _Slowloris(relay.http.port, sources, 120, scrape, trickle=False)
        try:
            for _ in range(3):
                base = f"http://127.0.0.1:{relay.http.probe_port}"
                assert http_get(base + "/healthz", timeout=PROBE_TIMEOUT_S) == (200, "ok")
                assert http_get(base + "/readyz", timeout=PROBE_TIMEOUT_S)[0] == 200
        finally:
            scrapes.stop()
            locker.rollback()


def test_the_probe_port_serves_probes_only(
    topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    relay = _ready(start_relay(subscribers=[sub("s", topic_prefix)]))
    assert relay.http is not None
    assert relay.http.probe_port not in (0, relay.http.port)
    status, body = http_get(f"http://127.0.0.1:{relay.http.probe_port}/metrics", timeout=10)
    assert status == 404 and "/metrics" not in body
    assert http_get(f"http://127.0.0.1:{relay.http.port}/metrics", timeout=10)[0] == 200
