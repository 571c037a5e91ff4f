"""Three of issue #31's levers, measured in-process (``time.thread_time``), no Kafka, no
relay: what each would save per event, and what it would change.

The outbox holds the throughput bench's rows (bench/harness.py ``fill_outbox``: ~300-byte
OrderPlaced payloads), fetched with the relay's own ``fetch_batch`` query in batches of
the relay's batch size (5,000). Each side of a lever runs once per round, interleaved
(bench/method.py), and its figure is the median of the rounds, in µs of this thread's CPU
per event.

1. **JSON passed through as bytes** (a json subscriber, default routing, no envelope).
   Today the store loads each payload's JSON text (``_payloads``: orjson over the batch)
   and the encoder writes it again (``_json_value``: orjson.dumps). Passed through, the
   encoder's value would be the fetched text itself. Sides: *today* (load the batch, then
   one ``_json_value`` call per event; the two steps are timed apart and added) against
   *pass-through* (one call per event of the relay's pass-through writer, issue #53,
   which returns the fetched bytes). The value's
   size both ways is a figure too (jsonb's text is not compact), and the details hold
   what a few JSON texts become both ways (numbers, nesting, escapes).
2. **Rows loaded as bytes.** One sweep of the outbox in batches, each batch a
   ``fetch_batch`` execute and its loading, five ways: *store* (``OutboxStore.fetch`` as
   the relay calls it: binary rows, psycopg's C loaders, events built in the store);
   *bytes → events* (binary rows, every column loaded as bytes by psycopg's C bytea
   loader, then the same OutboxEvent built from the bytes in Python: the first batch is
   checked equal to the store's); *typed tuples* (the store's cursor and loaders, rows
   fetched, no payload loaded, no event built); *bytes tuples* (the bytes rows, no
   events built); *execute only* (the query run and its result received, no row loaded: the floor
   under every side). The connection is made outside the clock.
3. **The session's time zone.** psycopg loads each row's ``occurred_at`` into the
   session's zone, and the commit-latency histogram subtracts it from now for every event
   published (``ages_of``). Sides: the store's fetch plus ``ages_of`` over its events,
   in a session whose ``TimeZone`` is ``Europe/Berlin`` or ``Etc/UTC`` (zoneinfo zones,
   as a server's default makes them) or ``UTC`` (what the daemon sets since #31:
   ``datetime.timezone.utc``). The two steps are timed apart.

4. **The libraries' floor.** What an event costs in the calls no glue can avoid, with
   the libraries the design card names: the fetch's rows (*typed tuples*, as in 2), the
   value's encoding by the library itself (fastavro's compiled writer as the relay calls
   it; orjson's load and dump), both in this thread's CPU, and the produce: the relay's
   records (its key and five headers) produced to the stack's broker, a Kafka
   transaction per 5,000, in this process's CPU (``getrusage``: librdkafka's threads
   included, as the relay's own figure includes them). Each round adds its three steps,
   so the floor has a range. A relay cannot spend less than this per event; #31's target
   is 6 µs. Beside it, ``produce()``'s call alone with the relay's headers and without
   (a producer whose broker never answers: nothing sent, queue purged outside the clock).

The garbage collector is set as ``outbox-relay run`` sets it (``tune_gc``) throughout.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from confluent_kafka import Producer
from psycopg.types.json import set_json_loads
from psycopg.types.string import ByteaBinaryLoader

from bench.harness import BATCH, SCHEMAS, Figure, Scale, Stack, create_topics, fill_outbox
from bench.method import Samples, interleave, settle
from bench.throughput import ceiling_producer, produce_batches, records_of
from relay.adapters.postgres.fetch_plan import _new_event, _not_read, plan
from relay.adapters.postgres.fetch_plan import load_row_json as _load_row_json
from relay.adapters.postgres.fetch_plan import payloads as _payloads
from relay.adapters.postgres.store import OutboxStore
from relay.core.formats.json_text import passed_through as _passthrough_value
from relay.core.formats.json_values import json_value as _json_value
from relay.core.model import KafkaRecord, OutboxEvent, Position, Unreadable
from relay.core.ports import Selection
from relay.core.schemas import SchemaFolder, encode_with
from relay.core.subscribers import ValueFormat
from relay.daemon import tune_gc
from relay.observability.latency import ages_of

MAX_BYTES = 4 * 1024 * 1024  # the relay's default batch_max_bytes
MAX_ROW_BYTES = 2 * 1_048_588  # twice message.max.bytes, as the relay sets it
SELECTION = Selection(BATCH, MAX_BYTES, max_row_bytes=MAX_ROW_BYTES)
TOPIC = "bench.orders"
# Every type the fetch_batch query returns, loaded as its wire bytes on the bytes sides.
BYTES_TYPES = ("int4", "int8", "text", "uuid", "jsonb", "timestamptz", "bytea")
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)  # where Postgres's binary timestamps count from
# What a few written JSON texts become, published today and passed through.
EXAMPLES = (
    '{"a":1,"b":[1,2]}',
    '{"b":1,"aa":2,"a":3,"a":4}',
    '{"n":1.50,"m":1E2,"f":1e-7}',
    '{"n":0.1000000000000000000001}',
    '{"n":12345678901234567890123}',
    '{"n":1e400}',
    '{"n":1e-400}',
    '{"s":"caf\\u00e9 \\/ \\n \\ud83d\\ude00"}',
    "[" * 300 + "]" * 300,
    "[" * 2000 + "]" * 2000,
)


def run(stack: Stack, scale: Scale) -> list[Figure]:
    with _relay_gc():
        return _run(stack, scale)


@contextlib.contextmanager
def _relay_gc() -> Iterator[None]:
    """The garbage collector as ``outbox-relay run`` sets it (fewer young-generation
    walks): at Python's defaults the sides that allocate most pay for walks the relay
    does not make. Put back after, for the benchmarks run next in this process."""
    thresholds = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _run(stack: Stack, scale: Scale) -> list[Figure]:
    batches = 4 if scale.name == "quick" else 10
    url = stack.database("levers")
    fill_outbox(url, batches * BATCH)
    settle(url)
    with psycopg.connect(url, autocommit=True) as conn:
        starts = _batch_starts(OutboxStore(conn))
        texts = _payload_texts(conn, starts[0])
        examples = [_example(conn, text) for text in EXAMPLES]
    return (
        _json_lever(texts, scale, examples)
        + _row_lever(url, starts, scale)
        + _zone_lever(url, starts, scale)
        + _floor_lever(stack, url, starts, texts, scale)
    )


# -- 1. JSON passed through ---------------------------------------------------------------


def _json_lever(texts: list[bytes], scale: Scale, examples: list[dict[str, Any]]) -> list[Figure]:
    loops = 4 if scale.name == "quick" else 20  # batches per round: 100k events
    loaded = _payloads(list(texts))
    template = _event(None)
    parts: dict[str, list[float]] = {"load": [], "dump": []}

    def today() -> float:
        load = dump = 0.0
        for _ in range(loops):
            start = time.thread_time()
            payloads = _payloads(list(texts))
            load += time.thread_time() - start
            events = [template._replace(payload=p) for p in payloads]
            start = time.thread_time()
            for event in events:
                _json_value(event, TOPIC)
            dump += time.thread_time() - start
        per = 1e6 / (loops * len(texts))
        parts["load"].append(load * per)
        parts["dump"].append(dump * per)
        return (load + dump) * per

    raw = [template._replace(payload=text) for text in texts]

    def passed() -> float:
        spent = 0.0
        for _ in range(loops):
            start = time.thread_time()
            for event in raw:
                _passthrough_value(event, TOPIC)
            spent += time.thread_time() - start
        return spent * 1e6 / (loops * len(texts))

    cpu = interleave({"today": today, "pass-through": passed}, scale.repetitions)
    compact = [_json_value(template._replace(payload=p), TOPIC) for p in loaded]
    size = sum(map(len, texts)) / len(texts)
    today_size = sum(map(len, compact)) / len(compact)
    details = {
        "events_per_round": loops * len(texts),
        "load_us": Samples(tuple(parts["load"])).as_json(),
        "dump_us": Samples(tuple(parts["dump"])).as_json(),
        "examples": examples,
    }
    return [
        Figure.of("levers", "JSON value CPU us/event, pass-through vs load+dump",
                  cpu["pass-through"], "us", cpu["today"], "orjson load + dump", None,
                  details),
        Figure("levers", "JSON value bytes/event, jsonb text vs compact", size, "B",
               today_size, "orjson compact", None, {"events": len(texts)}),
    ]  # fmt: skip


def _event(payload: Any) -> OutboxEvent:
    return OutboxEvent(0, 0, uuid.uuid4(), "order", "1", None, "OrderPlaced", payload, {},
                       _EPOCH)  # fmt: skip


def _payload_texts(conn: psycopg.Connection[Any], after: Position) -> list[bytes]:
    """One batch's payload column as the store fetches it: the JSON text as bytes."""
    with conn.cursor(binary=True) as cur:
        rows = _execute(cur, after).fetchall()
    return [row[7] for row in rows]


def _example(conn: psycopg.Connection[Any], written: str) -> dict[str, Any]:
    """What ``written`` (stored as jsonb) becomes: published today, and passed through."""
    row = conn.execute("SELECT convert_to(%s::jsonb::text, 'UTF8')", (written,)).fetchone()
    assert row is not None
    text: bytes = row[0]
    loaded = _load_row_json(text)
    if isinstance(loaded, Unreadable):
        published = f"poison: {loaded}"
    else:
        try:
            published = _json_value(_event(loaded), TOPIC).decode()
        except Exception as exc:  # EncodingError: poison at the encoder
            published = f"poison: {exc}"
    return {"written": _short(written), "today": _short(published),
            "pass_through": _short(text.decode())}  # fmt: skip


def _short(text: str) -> str:
    return text if len(text) <= 120 else f"{text[:100]}...({len(text)} characters)"


# -- 2. Rows loaded as bytes ----------------------------------------------------------


def _row_lever(url: str, starts: list[Position], scale: Scale) -> list[Figure]:
    rows = len(starts) * BATCH

    def side(
        sweep: Callable[[psycopg.Connection[Any], list[Position]], int],
    ) -> Callable[[], float]:
        def measure() -> float:
            with psycopg.connect(url, autocommit=True) as conn:
                start = time.thread_time()
                fetched = sweep(conn, starts)
                spent = time.thread_time() - start
            if fetched != rows:
                raise RuntimeError(f"fetched {fetched} rows of {rows}")
            return spent * 1e6 / rows

        return measure

    _check_same_events(url, starts[0])
    cpu = interleave(
        {"store": side(_store_sweep), "bytes events": side(_bytes_events_sweep),
         "typed tuples": side(_typed_tuples_sweep), "bytes tuples": side(_bytes_tuples_sweep),
         "execute only": side(_execute_sweep)},
        scale.repetitions,
    )  # fmt: skip
    details = {"rows_per_round": rows, "batch_size": BATCH,
               "typed_tuples_us": cpu["typed tuples"].as_json(),
               "execute_only_us": cpu["execute only"].as_json()}  # fmt: skip
    return [
        Figure.of("levers", "fetch CPU us/row, bytes -> same OutboxEvent vs store",
                  cpu["bytes events"], "us", cpu["store"], "store today", None, details),
        Figure.of("levers", "fetch CPU us/row, typed tuples (no events) vs store",
                  cpu["typed tuples"], "us", cpu["store"], "store today", None, details),
        Figure.of("levers", "fetch CPU us/row, tuples of bytes (no events) vs store",
                  cpu["bytes tuples"], "us", cpu["store"], "store today", None, details),
        Figure.of("levers", "fetch CPU us/row, execute only (no rows loaded) vs store",
                  cpu["execute only"], "us", cpu["store"], "store today", None, details),
    ]  # fmt: skip


def _batch_starts(store: OutboxStore) -> list[Position]:
    """Where each full batch of the outbox starts: every side fetches the same batches."""
    starts: list[Position] = []
    after = Position(0, 0)
    while True:
        got = store.fetch(after, SELECTION)
        if len(got.events) < BATCH or got.read_to is None:
            return starts
        starts.append(after)
        after = got.read_to


def _execute(cur: psycopg.Cursor[Any], after: Position) -> psycopg.Cursor[Any]:
    """The store's fetch_batch, executed as the store executes it (prepared, one part)."""
    fetch = plan("public", SELECTION)
    return cur.execute(fetch.query, fetch.params_after(after), prepare=True)


def _store_sweep(conn: psycopg.Connection[Any], starts: list[Position]) -> int:
    store = OutboxStore(conn)
    return sum(len(store.fetch(after, SELECTION).events) for after in starts)


def _bytes_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A binary cursor that loads every column of the fetch as its wire bytes (psycopg
    picks its C bytea loader for each)."""
    cur = conn.cursor(binary=True)
    for name in BYTES_TYPES:
        cur.adapters.register_loader(name, ByteaBinaryLoader)
    return cur


def _sweep(
    cur: psycopg.Cursor[Any], starts: list[Position], rows: Callable[[psycopg.Cursor[Any]], int]
) -> int:
    """Run the fetch from each of ``starts`` on ``cur``; the rows ``rows`` counts of each."""
    with cur:
        return sum(rows(_execute(cur, after)) for after in starts)


def _typed_tuples_sweep(conn: psycopg.Connection[Any], starts: list[Position]) -> int:
    """The store's cursor and loaders, its rows fetched, no payload loaded, no event."""
    cur = conn.cursor(binary=True)
    set_json_loads(_load_row_json, cur)
    return _sweep(cur, starts, lambda c: len(c.fetchall()))


def _bytes_tuples_sweep(conn: psycopg.Connection[Any], starts: list[Position]) -> int:
    return _sweep(_bytes_cursor(conn), starts, lambda c: len(c.fetchall()))


def _bytes_events_sweep(conn: psycopg.Connection[Any], starts: list[Position]) -> int:
    return _sweep(_bytes_cursor(conn), starts, lambda c: len(events_from_bytes(c.fetchall())))


def _execute_sweep(conn: psycopg.Connection[Any], starts: list[Position]) -> int:
    return _sweep(conn.cursor(binary=True), starts, lambda c: c.rowcount)


def _int(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


def _uuid(data: bytes) -> uuid.UUID:
    """A UUID without UUID.__init__'s checks, as psycopg's own loader makes it."""
    value = object.__new__(uuid.UUID)
    object.__setattr__(value, "int", int.from_bytes(data, "big"))
    object.__setattr__(value, "is_safe", uuid.SafeUUID.unknown)
    return value


def events_from_bytes(rows: Sequence[tuple[Any, ...]]) -> list[OutboxEvent]:
    """The store's events, built in Python from rows of wire bytes (binary format: jsonb
    is a version byte and its text; timestamps are µs since 2000)."""
    payloads = _payloads([row[7] for row in rows])
    return [
        _new_event((
            _int(tx), _int(pos), _uuid(mid), atype.decode(), aid.decode(),
            None if version is None else _int(version), etype.decode(),
            payload if big is None else _not_read(_int(big), MAX_ROW_BYTES),
            {} if headers is None else _load_row_json(headers[1:]),
            _EPOCH + timedelta(microseconds=_int(at)), _int(size),
            None if dbz is None else _load_row_json(dbz[1:]), id_text,
        ))
        for (tx, pos, mid, atype, aid, version, etype, _, headers, at, size, dbz, big,
             id_text), payload in zip(rows, payloads, strict=True)
    ]  # fmt: skip


def _check_same_events(url: str, after: Position) -> None:
    """The bytes side must build what the store builds, or its figure means nothing."""
    with psycopg.connect(url, autocommit=True) as conn:
        expected = OutboxStore(conn).fetch(after, SELECTION).events
        with _bytes_cursor(conn) as cur:
            rows = _execute(cur, after).fetchall()
    if any(not isinstance(v, bytes | None) for row in rows for v in row):
        raise RuntimeError("a column did not load as bytes")
    if events_from_bytes(rows) != expected:
        raise RuntimeError("events built from bytes differ from the store's")


# -- 3. The session's time zone ------------------------------------------------------------

ZONES = ("Europe/Berlin", "Etc/UTC", "UTC")


def _zone_lever(url: str, starts: list[Position], scale: Scale) -> list[Figure]:
    rows = len(starts) * BATCH
    parts: dict[str, dict[str, list[float]]] = {z: {"fetch": [], "ages": []} for z in ZONES}

    def side(zone: str) -> Callable[[], float]:
        def measure() -> float:
            fetch = ages = 0.0
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT set_config('TimeZone', %s, false)", (zone,))
                store = OutboxStore(conn)
                for after in starts:
                    start = time.thread_time()
                    events = store.fetch(after, SELECTION).events
                    middle = time.thread_time()
                    ages_of(events, datetime.now(UTC))
                    fetch, ages = fetch + middle - start, ages + time.thread_time() - middle
            parts[zone]["fetch"].append(fetch * 1e6 / rows)
            parts[zone]["ages"].append(ages * 1e6 / rows)
            return (fetch + ages) * 1e6 / rows

        return measure

    cpu = interleave({zone: side(zone) for zone in ZONES}, scale.repetitions)
    details = {
        "rows_per_round": rows,
        **{
            f"{zone}_{step}_us": Samples(tuple(values)).as_json()
            for zone, steps in parts.items()
            for step, values in steps.items()
        },
    }
    return [
        Figure.of("levers", f"fetch + ages CPU us/row, session in UTC vs {zone}",
                  cpu["UTC"], "us", cpu[zone], f"session in {zone}", None, details)
        for zone in ZONES[:2]
    ]  # fmt: skip


# -- 4. The libraries' floor ----------------------------------------------------------------


def _floor_lever(
    stack: Stack, url: str, starts: list[Position], texts: list[bytes], scale: Scale
) -> list[Figure]:
    loops = 4 if scale.name == "quick" else 20  # batches per round, as lever 1
    with psycopg.connect(url, autocommit=True) as conn:
        events = OutboxStore(conn).fetch(starts[0], SELECTION).events
    schema = SchemaFolder.from_dir(SCHEMAS).writer_for(events[0].event_type)
    payloads = [event.payload for event in events]
    records = records_of(events, ValueFormat.JSON)  # the relay's record: key and headers
    sent = loops * len(records)
    rows = len(starts) * BATCH
    topic = f"{stack.topic_prefix('floor')}.orders"
    create_topics(stack.bootstrap, [topic], 3)  # as the relay creates its topics

    def per_event(step: Callable[[], object]) -> Callable[[], float]:
        def measure() -> float:
            start = time.thread_time()
            for _ in range(loops):
                step()
            return (time.thread_time() - start) * 1e6 / sent

        return measure

    def fetched() -> float:
        with psycopg.connect(url, autocommit=True) as conn:
            start = time.thread_time()
            _typed_tuples_sweep(conn, starts)
            return (time.thread_time() - start) * 1e6 / rows

    def produced() -> float:
        producer = ceiling_producer(stack.bootstrap, topic)
        start = _process_cpu()
        produce_batches(producer, topic, records, sent, transactional=True)
        return (_process_cpu() - start) * 1e6 / sent

    cpu = interleave(
        {"rows": fetched,
         "fastavro": per_event(lambda: [encode_with(schema, p) for p in payloads]),
         "orjson": per_event(lambda: _json_round_trip(texts)),
         "transactional produce": produced,
         **_produce_calls(records, loops)},
        scale.repetitions,
    )  # fmt: skip
    details: dict[str, Any] = {name: samples.as_json() for name, samples in cpu.items()}
    details["events_per_round"] = sent
    steps = (cpu["rows"], cpu["transactional produce"])
    return [
        Figure.of("levers", f"library floor CPU us/event, {name}",
                  _added(cpu[value], *steps), "us", target="value<=6",
                  details={**details, "steps": ["rows (typed tuples)", value,
                                                "transactional produce (process)"]})
        for name, value in (("Avro", "fastavro"), ("JSON", "orjson"))
    ] + [
        Figure.of("levers", "produce() call CPU us/record, the relay's headers vs none",
                  cpu["produce() call"], "us", cpu["produce() call, no headers"], "no headers",
                  None, details),
    ]  # fmt: skip


def _produce_calls(records: list[KafkaRecord], loops: int) -> dict[str, Callable[[], float]]:
    """``produce()``'s own cost per record, with the records' headers and without, to a
    producer that never sends (its queue purged after each round, outside the clock)."""
    producer = Producer({**UNANSWERED, "queue.buffering.max.messages": 2 * len(records) * loops})
    produce = producer.produce

    def with_headers() -> None:
        for r in records:
            produce(TOPIC, r.value, r.key, headers=r.headers)

    def without() -> None:
        for r in records:
            produce(TOPIC, r.value, r.key)

    def side(step: Callable[[], None]) -> Callable[[], float]:
        def measure() -> float:
            start = time.thread_time()
            try:
                for _ in range(loops):
                    step()
                return (time.thread_time() - start) * 1e6 / (loops * len(records))
            finally:
                producer.purge()
                producer.poll(0)  # the purged records' reports: only then are they freed

        return measure

    return {"produce() call": side(with_headers), "produce() call, no headers": side(without)}


def _json_round_trip(texts: list[bytes]) -> list[bytes]:
    """orjson as the relay calls it: a batch's texts loaded, each value dumped and copied
    out of orjson's 4 KiB buffer (kept, a batch of those buffers cost a page fault each)."""
    return [memoryview(orjson.dumps(payload)).tobytes() for payload in map(orjson.loads, texts)]


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# A producer whose broker never answers: produce() queues, and nothing is sent.
UNANSWERED = {"bootstrap.servers": "127.0.0.1:9", "log_level": 0, "linger.ms": 60_000}


def _added(*steps: Samples) -> Samples:
    """Each round's steps added: the floor of that round."""
    return Samples(tuple(map(sum, zip(*(step.values for step in steps), strict=True))))
