"""/metrics, /healthz and /readyz of a running relay."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import PartId
from relay.core.worker_stats import WorkerState
from relay.daemon import Relay
from tests.support import (
    http_get,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
    worker,
    write_orders,
)


def get(relay: Relay, path: str) -> tuple[int, str]:
    assert relay.http is not None
    return http_get(f"http://127.0.0.1:{relay.http.port}{path}", timeout=10)


def sample(metrics: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_health_and_readiness(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_reads_all_stats: None,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    write_orders(writer_db, outbox, ["o-1", "o-2", "o-3"])
    wait_caught_up(db, "s")

    assert get(relay, "/healthz")[0] == 200
    status, why = get(relay, "/readyz")
    assert status == 200 and "ready" in why

    # An open transaction holding an xid holds back the publication horizon.
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT pg_current_xact_id()")
        time.sleep(1.1)
        status, metrics = get(relay, "/metrics")
        holder.rollback()
    assert status == 200
    assert sample(metrics, "outbox_relay_published_events_total", subscriber="s", part="0") == 3
    assert (
        sample(metrics, "outbox_relay_published_bytes_total", subscriber="s", part="0") or 0
    ) > 0
    assert sample(metrics, "outbox_relay_lag_events", subscriber="s", part="0") == 0
    assert sample(metrics, "outbox_relay_part_claimed", subscriber="s", part="0") == 1
    assert sample(metrics, "outbox_relay_part_halted", subscriber="s", part="0") == 0
    assert sample(metrics, "outbox_relay_live_sessions") == 1
    assert (sample(metrics, "outbox_relay_horizon_held_seconds") or 0) >= 1.0
    assert get(relay, "/nope")[0] == 404

    relay.stop()


def test_status_shows_parts_sessions_and_who_holds_the_horizon(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    relay_url: str,
    writer_url: str,
    relay_db: psycopg.Connection[Any],
    relay_reads_all_stats: None,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
    caplog: Any,
) -> None:
    import json
    import logging

    relay = start_relay(subscribers=[sub("s", topic_prefix, parts=2)], horizon_warn_after=0.5)
    write_orders(writer_db, outbox, ["o-1"])
    with psycopg.connect(writer_url, application_name="slow-batch-job") as holder:
        holder.execute("SELECT pg_current_xact_id()")
        write_orders(holder, outbox, ["o-2"])  # an event of the open transaction
        time.sleep(1.0)
        result = run_cli("status", "--json", env={"RELAY_DATABASE_URL": relay_url})
        with caplog.at_level(logging.WARNING, logger="relay.daemon"):
            relay.horizon.check(OutboxStore(relay_db))
        holder.rollback()
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(p["part"] for p in report["parts"]) == ["s/0", "s/1"]
    assert all(p["owner"] for p in report["parts"])
    assert len(report["sessions"]) == 1 and report["sessions"][0]["parts"] == 2
    [holder_row] = report["horizon_holders"]
    assert holder_row["application_name"] == "slow-batch-job" and holder_row["age_s"] >= 1.0
    assert "slow-batch-job" in caplog.text and "held back" in caplog.text


def test_probes_and_scrapes_answer_while_the_outbox_is_locked(
    db: psycopg.Connection[Any],
    outbox: Outbox,
    database_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """A table lock stalls every read of the outbox: the probes must still answer (a
    liveness probe that times out restarts every replica at once), and scrapes serve the
    last figures read, with their age. The relay's queries give up on the lock after
    database_lock_timeout and are retried: no part halts."""
    relay = start_relay(
        subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0, database_lock_timeout=0.2
    )
    assert relay.http is not None
    base = f"http://127.0.0.1:{relay.http.port}"
    write_orders(db, outbox, ["o-1"])
    wait_caught_up(db, "s")
    status, before = get(relay, "/metrics")
    assert sample(before, "outbox_relay_lag_events", subscriber="s", part="0") == 0
    with psycopg.connect(database_url) as locker, ThreadPoolExecutor(4) as pool:
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        # Scrapes in flight (Prometheus retries, several of them), all stuck on the lock...
        scrapes = [pool.submit(http_get, base + "/metrics", 60) for _ in range(4)]
        time.sleep(0.5)
        # ...and the probes answer within the kubelet's timeout regardless.
        assert http_get(base + "/healthz", timeout=3) == (200, "ok")
        assert http_get(base + "/readyz", timeout=3)[0] == 200
        status, during = http_get(base + "/metrics", timeout=30)
        assert status == 200
        assert sample(during, "outbox_relay_lag_events", subscriber="s", part="0") == 0
        assert (sample(during, "outbox_relay_database_metrics_age_seconds") or 0) > 0
        assert all(scrape.result()[0] == 200 for scrape in scrapes)
        locker.rollback()
    write_orders(db, outbox, ["o-2"])
    wait_caught_up(db, "s")
    assert relay.part_states()[PartId("s", 0)] != "halted"


def _open_idle(port: int, count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """Clients that connect and never send a byte."""
    return [socket.create_connection((host, port), timeout=10) for _ in range(count)]


def _open_slow(port: int, count: int) -> list[socket.socket]:
    """Clients that send half a request line and stall."""
    clients = _open_idle(port, count)
    for client in clients:
        client.sendall(b"GET /metr")
    return clients


def test_idle_and_slow_clients_cost_no_threads_and_the_server_still_answers(
    topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    relay = start_relay(subscribers=[sub("s", topic_prefix)])
    assert relay.http is not None
    port = relay.http.port
    assert get(relay, "/healthz")[0] == 200
    threads_before = threading.active_count()
    stalled = _open_idle(port, 60) + _open_slow(port, 30)
    try:
        for _ in range(3):  # answered while 90 clients hold connections open
            assert get(relay, "/healthz")[0] == 200
            status, metrics = get(relay, "/metrics")
            assert status == 200 and "outbox_relay_lag_events" in metrics
        # 8 at once, as the scrape storm below: one address holds at most 16 connections.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: get(relay, "/readyz")[0], range(300)))
        assert answers == [200] * 300
        # A few threads of the relay's own may come and go; 90 held connections cost none.
        assert threading.active_count() <= threads_before + 3, "connections cost threads"
    finally:
        for client in stalled:
            client.close()


class _Idle:
    """A relay that is healthy and has nothing else to say."""

    def healthy(self) -> tuple[bool, str]:
        return True, "ok"


def _idle_server() -> Any:
    from relay.core.settings import Settings
    from relay.daemon.metrics import HealthServer

    def no_database() -> Any:
        raise AssertionError("not scraped")

    settings = Settings(metrics_host="127.0.0.1", metrics_port=0)
    server = HealthServer(_Idle(), no_database, settings)  # type: ignore[arg-type]
    server.start()
    return server


def _exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """The server's first reply to raw ``request`` bytes (a client timeout fails it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as client:
        client.sendall(request)
        return client.recv(4096)


def test_bodies_and_methods_other_than_get_and_head_are_refused() -> None:
    server = _idle_server()
    try:
        port = server.port
        # A huge declared body is refused from its headers: nothing is read, so nothing
        # spooled to a temporary file (waitress buffers bodies over 512 KB on disk).
        huge = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 209715200\r\n\r\n"
        assert _exchange(port, huge).startswith(b"HTTP/1.1 413 ")
        chunked = (
            b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"10\r\n0123456789abcdef\r\n"
        )
        assert _exchange(port, chunked).startswith(b"HTTP/1.1 413 ")
        for method in (b"POST", b"PUT", b"DELETE", b"OPTIONS"):
            reply = _exchange(port, method + b" /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 405 ") and b"Allow: GET, HEAD" in reply, method
        head = _exchange(port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert http_get(f"http://127.0.0.1:{port}/healthz", timeout=10) == (200, "ok")
    finally:
        server.stop()


def test_a_silent_client_is_disconnected() -> None:
    from relay.daemon.listener import CLIENT_TIMEOUT_S

    server = _idle_server()
    try:
        [client] = _open_idle(server.port, 1)
        client.settimeout(CLIENT_TIMEOUT_S * 4)
        assert client.recv(1) == b"", "the server closes a connection that stays silent"
        client.close()
    finally:
        server.stop()


def test_the_endpoints_answer_in_a_process_holding_over_1024_descriptors() -> None:
    # A relay of 100 parts holds that many (a connection and a producer's sockets each).
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        server = _idle_server()
        try:
            assert http_get(f"http://127.0.0.1:{server.port}/healthz", timeout=10) == (200, "ok")
        finally:
            server.stop()
    finally:
        for fd in held:
            os.close(fd)


def test_the_server_stops_when_its_loop_has_closed_its_wake_up_pipe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # waitress's loop closes that pipe itself when poll() reports it hung up or invalid
    # (CI saw stop() fail with EBADF once, the cause of the report not found); here the
    # loop is made to close it the way it would.
    server = _idle_server()
    trigger = server.listener._server.trigger
    trigger.pull_trigger(trigger.close)
    deadline = time.monotonic() + 10
    while not trigger._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trigger._closed
    with caplog.at_level(logging.WARNING, logger="relay.daemon.listener"):
        server.stop()
    assert not server.listener._thread.is_alive(), "the loop ends once its sockets are closed"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    assert [r.event for r in caplog.records] == ["http_wakeup_lost"]  # type: ignore[attr-defined]


def test_scrape_storms_share_one_read_of_postgres(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=300)
    OutboxStore(db).set_paused("s", True)
    write_orders(writer_db, outbox, ["o-1"])
    first = sample(get(relay, "/metrics")[1], "outbox_relay_lag_events", subscriber="s", part="0")
    write_orders(writer_db, outbox, ["o-2", "o-3"])
    # 8 at once: one address may hold 16 connections (issue #47), and a client's
    # closed connection may still count there while its next one opens.
    with ThreadPoolExecutor(8) as pool:
        storm = list(pool.map(lambda _: get(relay, "/metrics"), range(50)))
    assert {status for status, _ in storm} == {200}
    lags = {sample(body, "outbox_relay_lag_events", subscriber="s", part="0") for _, body in storm}
    assert first == 1 and lags == {1}, "within the TTL every scrape reuses the first read"


def test_the_metrics_port_listens_where_metrics_host_says(
    topic_prefix: str, start_relay: Callable[..., Relay]
) -> None:
    from relay.core.settings import load_settings

    assert load_settings().metrics_host == "127.0.0.1"  # loopback unless told otherwise
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_host="127.0.0.2")
    assert relay.http is not None
    with urllib.request.urlopen(f"http://127.0.0.2:{relay.http.port}/healthz", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", relay.http.port), timeout=10)


def _wait_halted(db: psycopg.Connection[Any], name: str, timeout: float = 60.0) -> str:
    store = OutboxStore(db)
    deadline = time.monotonic() + timeout
    while (error := store.get_part(name, 0).halted_error) is None:
        assert time.monotonic() < deadline, f"part {name}/0 never halted"
        time.sleep(0.1)
    return error


def _status_text(relay_url: str) -> str:
    result = run_cli("status", env={"RELAY_DATABASE_URL": relay_url, "COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_poison_halt_shows_in_metrics_readiness_and_status(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    # Written by plain SQL with no Avro schema: the Avro subscriber cannot encode it.
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', 'x', 'Unknown', '{}')"
    )
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0)
    error = _wait_halted(db, "s")
    metrics = get(relay, "/metrics")[1]
    assert sample(metrics, "outbox_relay_part_halted", subscriber="s", part="0") == 1
    deadline = time.monotonic() + 60  # the worker records its own state just after
    while relay.part_states()[PartId("s", 0)] != "halted":
        assert time.monotonic() < deadline, relay.part_states()
        time.sleep(0.05)
    status, why = get(relay, "/readyz")
    assert status == 200 and "halted: s/0" in why  # ready, yet naming it (see Relay.ready)
    text = _status_text(relay_url)
    assert "HALTED" in text and "1 halted part(s)" in text and "subscribers resume" in text
    assert f"s/0: {error}" in text and "Unknown" in error

    # The halted worker loses its claim and ends on its own: not a worker failure.
    halted_worker = worker(relay, "s")
    db.execute("UPDATE outbox_checkpoints SET owner = NULL WHERE subscriber = 's'")
    deadline = time.monotonic() + 60
    while relay.workers.get(PartId("s", 0)) in (None, halted_worker):
        assert time.monotonic() < deadline, "the part was never claimed again"
        time.sleep(0.05)
    metrics = get(relay, "/metrics")[1]
    assert not sample(metrics, "outbox_relay_worker_failures_total", subscriber="s", part="0")
    assert OutboxStore(db).get_part("s", 0).halted_error == error


def test_a_worker_that_stops_on_a_fatal_error_halts_its_part_visibly(
    db: psycopg.Connection[Any],
    relay_url: str,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    """A worker that stops on an error retrying cannot fix (here a producer setting
    librdkafka refuses) must not vanish into a silent restart loop."""
    relay = start_relay(
        subscribers=[sub("s", topic_prefix)],
        kafka={"compression.type": "bogus"},
        metrics_cache_ttl=0,
    )
    error = _wait_halted(db, "s")
    assert error.startswith("part worker stopped:") and "compression" in error
    metrics = get(relay, "/metrics")[1]
    assert sample(metrics, "outbox_relay_part_halted", subscriber="s", part="0") == 1
    failures = sample(metrics, "outbox_relay_worker_failures_total", subscriber="s", part="0")
    assert failures is not None and failures >= 1
    text = _status_text(relay_url)
    assert "HALTED" in text and f"s/0: {error}" in text


def test_publish_stalled_seconds_counts_only_while_events_wait(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    topic_prefix: str,
    start_relay: Callable[..., Relay],
) -> None:
    relay = start_relay(subscribers=[sub("s", topic_prefix)], metrics_cache_ttl=0)
    write_orders(writer_db, outbox, ["o-1"])
    wait_caught_up(db, "s")
    time.sleep(1.5)  # an idle part's checkpoint ages; it is not stalled
    metrics = get(relay, "/metrics")[1]
    assert sample(metrics, "outbox_relay_publish_stalled_seconds", subscriber="s", part="0") == 0

    OutboxStore(db).set_paused("s", True)  # events wait, nothing publishes them
    # The part sees the pause at its next look, not at once: write only once it has.
    wait_until(
        lambda: relay.part_states().get(PartId("s", 0)) == WorkerState.PAUSED,
        what="the part to pause",
    )
    write_orders(writer_db, outbox, ["o-2"])
    time.sleep(1.5)
    metrics = get(relay, "/metrics")[1]
    stalled = sample(metrics, "outbox_relay_publish_stalled_seconds", subscriber="s", part="0")
    assert stalled is not None and stalled >= 1.0
    relay.stop()
