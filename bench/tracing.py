"""The cost of tracing: relay throughput with ``tracing = true`` against tracing off.

One ``outbox-relay run`` process publishes the same backlog of 300-byte Avro events
through a new subscriber each run, clocked from the resume of its paused subscriber to
its last checkpoint (bench/README.md "Method"); the sides alternate, off, a span per
batch (``tracing_spans = "batch"``, the default), a span per event (``"event"``), for
``scale.repetitions`` rounds. Every row carries a sampled W3C ``traceparent`` of its own
(as ``relay.trace_headers()`` writes it inside a writer's span): per event, the relay
records and exports a span for every event, the worst case, sampling does not help;
per batch, a span per batch with a link per traced event (at most
``tracing_batch_links`` of a batch, the default 128; the rest keep their writer's
context). The spans go over OTLP/HTTP to a collector in this process that counts requests
and bytes without decoding them (the relay's exporting is measured, not a collector's).

A second figure is the sampled case, as with a writer sampling 1% of its traces: every
row carries a traceparent, one in a hundred of them sampled; the relay records a span for
those only.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from bench.harness import (
    BATCH,
    Figure,
    Scale,
    Stack,
    fresh_subscribers,
    order_payload,
    paused_drain,
)
from bench.method import interleave, settle
from relay.core.subscribers import Subscriber

# The SDK's default queue (2,048 spans) drops spans once a backlog publishes faster
# than they are exported: the bench would then measure less work than tracing every
# event. Large enough to hold a batch's spans while the last batch's are exported.
QUEUE = {"OTEL_BSP_MAX_QUEUE_SIZE": "100000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2048"}


class Sink:
    """An OTLP/HTTP endpoint that answers 200 to everything and counts what it got."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                sink.requests += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fill_traced(url: str, events: int, *, sampled_every: int, keys: int = 1000) -> None:
    """COPY ``events`` OrderPlaced rows, each with a traceparent of its own, one in
    ``sampled_every`` of them sampled."""
    payload = json.dumps(order_payload())
    with psycopg.connect(url) as conn:
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
                "FROM STDIN"
            ) as copy,
        ):
            for i in range(events):
                trace = os.urandom(16).hex()
                flags = "01" if i % sampled_every == 0 else "00"
                headers = {"traceparent": f"00-{trace}-{os.urandom(8).hex()}-{flags}"}
                copy.write_row(
                    ("order", str(i % keys), "OrderPlaced", payload, json.dumps(headers))
                )
        conn.commit()
        conn.execute("ANALYZE outbox")
        conn.commit()


def run(stack: Stack, scale: Scale) -> list[Figure]:
    # Not throughput's million: with every span exported a run takes minutes (the
    # benchmark's own figure); 200,000 (quick: 100,000) is 40 full batches or more.
    events = scale.events
    sink = Sink()
    try:
        every = _compare(stack, scale, events, sink, sampled_every=1)
        sampled = _compare(stack, scale, events, sink, sampled_every=100)
    finally:
        sink.close()
    figures = []
    for rates, details, rows in (
        (*every, "every row traced"),
        (*sampled, "1% sampled by the writers"),
    ):
        for mode, what in (("batch", "a span per batch (default)"), ("event", "a span per event")):
            figures.append(
                Figure.of(
                    "tracing",
                    f"relay ev/s, tracing on, {what} ({rows}) vs off",
                    rates[mode],
                    "ev/s",
                    rates["off"],
                    "tracing off",
                    "ratio>=0.8",
                    details,
                )
            )
    return figures  # fmt: skip


def _compare(
    stack: Stack, scale: Scale, events: int, sink: Sink, *, sampled_every: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    label = f"sampled{sampled_every}"
    url = stack.database(f"tracing_{label}")
    fill_traced(url, events, sampled_every=sampled_every)
    settle(url)
    rounds = [0]
    cpu: dict[str, list[dict[str, float]]] = {"off": [], "batch": [], "event": []}
    exported: dict[str, list[tuple[int, int]]] = {"batch": [], "event": []}

    def side(spans: str | None) -> Callable[[], float]:
        def measure() -> float:
            rounds[0] += 1
            topic = f"{stack.topic_prefix(label)}.orders"
            fresh_subscribers(url, [Subscriber(f"bench{rounds[0]}", topic=topic)])
            env: dict[str, Any] = {"batch_size": BATCH}
            if spans is not None:
                env |= {"tracing": "true", "tracing_endpoint": sink.url, "tracing_spans": spans}
            before = (sink.requests, sink.bytes)
            os.environ.update(QUEUE)
            try:
                drain = paused_drain(stack, url, f"tracing_{label}", 1, **env)
            finally:
                for key in QUEUE:
                    os.environ.pop(key, None)
            if spans is not None:
                exported[spans].append((sink.requests - before[0], sink.bytes - before[1]))
            cpu[spans or "off"].append(drain.cpu)
            return events / drain.seconds

        return measure

    sides = {"off": side(None), "batch": side("batch"), "event": side("event")}
    rates = interleave(sides, scale.repetitions, before_each=lambda: settle(url, 1.0))
    details = {
        "events": events,
        "rows_sampled_by_writers": 1 / sampled_every,
        "otlp_requests_bytes_per_run": exported,
        **{f"cpu_{name}": runs for name, runs in cpu.items()},
    }
    return rates, details
