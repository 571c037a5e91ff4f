"""Postgres's CPU per row of the relay's unfiltered poll (issue #31, "Then speed"), and
where it goes: the poll (``fetch_batch``) against a plain keyset read of the same rows,
and against variants of the poll with one group of its expressions removed at a time.

The outbox holds the fan-out bench's rows (as bench/fanout_fetch.py: 1M rows of ~300-byte
JSON payload, 100 aggregate types in turn, one transaction). Every side sweeps it from
the start to the end in batches of 1,000 on a fresh connection, binary and prepared as
the relay fetches; its figure is that connection's backend CPU per row
(``/proc/<pid>/stat``), its wall per row beside it. The sides:

* *poll*: ``OutboxStore.fetch`` as the relay calls it (``fetch_batch``); *poll, raw*:
  the same query by the raw sweep of the sides below, their baseline.
* *plain*: ``SELECT`` of the poll's columns as they are stored, keyset-bounded below the
  horizon, ``ORDER BY`` the key, ``LIMIT``: no byte cut, no expression. The floor.
* *plain + outputs*: the plain read with the poll's output expressions (payload as
  JSON text bytes, headers NULL when empty, the ``occurred_at`` clamp, the id's text,
  ``transaction_id`` as a bigint), still without the cuts and the nesting.
* the poll with one group removed: each ``VARIANTS`` entry rewrites the poll's text
  (the row need not stay correct: these are measurements, not queries to ship).

The raw sides load jsonb as bytes and take the xid8 key as its 8 bytes, so the client
does little; the store's slower client adds a little to the backend's figure too (the
poll both ways, bench/RESULTS.md), hence the raw poll as the variants' baseline."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import Format

from bench.fanout_fetch import MAX_BYTES, MAX_ROW_BYTES, TYPES, backend_cpu_side, unfiltered
from bench.harness import Figure, Scale, Stack, fill_outbox
from bench.method import Samples, interleave, settle
from relay.adapters.postgres.queries import parse_named, queries_for, read_sql
from relay.adapters.postgres.store import OutboxStore

BATCH = 1000  # as fanout_fetch's unfiltered side on 1M rows

PLAIN = """
SELECT transaction_id, position, message_id, aggregate_type, aggregate_id,
       aggregate_version, event_type, payload, headers, occurred_at
  FROM outbox
 WHERE (transaction_id, position) > (%(transaction_id)s::text::xid8, %(position)s)
   AND transaction_id < pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
 ORDER BY transaction_id, position
 LIMIT %(limit)s"""

# ORDER BY names the table's xid8 column: the bigint output is named transaction_id too,
# and sorting by it is a sort of the whole backlog.
PLAIN_OUTPUTS = """
SELECT o.transaction_id::text::bigint, o.position, o.message_id, o.aggregate_type,
       o.aggregate_id, o.aggregate_version, o.event_type, pg_catalog.convert_to(o.payload::text, 'UTF8'),
       nullif(o.headers, '{}'::jsonb),
       least(greatest(o.occurred_at, '0001-01-02 00:00+00'), '9999-12-30 00:00+00'),
       pg_catalog.convert_to(o.message_id::text, 'UTF8')
  FROM outbox o
 WHERE (o.transaction_id, o.position) > (%(transaction_id)s::text::xid8, %(position)s)
   AND o.transaction_id < pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
 ORDER BY o.transaction_id, o.position
 LIMIT %(limit)s"""

_CUT = "CASE WHEN b.too_large AND pg_catalog.octet_length(b.{0}) > 200 THEN pg_catalog.left(b.{0}, 200) || '...[cut: ' || pg_catalog.octet_length(b.{0}) || ' bytes]' ELSE b.{0} END"
_STORED_SUM = "pg_catalog.sum(pg_catalog.pg_column_size(o.payload) + pg_catalog.pg_column_size(o.headers)) OVER (ORDER BY o.transaction_id, o.position ROWS UNBOUNDED PRECEDING)"
_COUNTED_SUM = "pg_catalog.sum(m.counted_bytes) OVER (ORDER BY m.transaction_id, m.position ROWS UNBOUNDED PRECEDING)"
# The size rule, as the poll renders it (fetch_rules.sql; its comment is not sent).
_MEASURE = re.sub(r"--[^\n]*\n", "", parse_named(read_sql("fetch_rules.sql"))["row_bytes"])
_PAYLOAD = "pg_catalog.convert_to(b.payload::text, 'UTF8')"

# The poll with one group of expressions removed or simplified: (old, new) rewrites of its
# text, whitespace-insensitive; every old must occur.
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "no stored-bytes window": ((_STORED_SUM, "0::bigint"),),
    "no counted-bytes window": ((_COUNTED_SUM, "0::bigint"),),
    "no windows": ((_STORED_SUM, "0::bigint"), (_COUNTED_SUM, "0::bigint")),
    "no row measure": ((_MEASURE, "s.stored_bytes::bigint AS row_bytes"),),
    "no CASEs": (
        *((_CUT.format(c), f"b.{c}") for c in ("aggregate_type", "aggregate_id", "event_type")),
        (f"CASE WHEN NOT b.too_large THEN {_PAYLOAD} END", _PAYLOAD),
        ("CASE WHEN NOT b.too_large THEN nullif(b.headers, '{}'::jsonb) END",
         "nullif(b.headers, '{}'::jsonb)"),
        ("CASE WHEN NOT b.too_large THEN b.debezium END", "b.debezium"),
        ("CASE WHEN b.too_large THEN b.row_bytes END", "NULL::bigint"),
    ),
    "payload as jsonb": ((_PAYLOAD, "b.payload"),),
    "payload by textsend": ((_PAYLOAD, "pg_catalog.textsend(b.payload::text)"),),
    "no payload": ((_PAYLOAD, "NULL::bytea"),),
    "headers, no nullif": (("nullif(b.headers, '{}'::jsonb)", "b.headers"),),
    "no id_text": (("pg_catalog.convert_to(b.message_id::text, 'UTF8')", "NULL::bytea"),),
    "no occurred_at clamp": (
        ("least(greatest(b.occurred_at, '0001-01-02 00:00+00'), '9999-12-30 00:00+00')",
         "b.occurred_at"),
    ),
    "transaction_id as xid8": (("b.transaction_id::text::bigint", "b.transaction_id"),),
}  # fmt: skip


def run(stack: Stack, scale: Scale) -> list[Figure]:
    url = stack.database("fetch_cost")
    fill_outbox(url, scale.fanout_events, types=TYPES)
    settle(url)
    return measure(url, scale.fanout_events, scale.repetitions)


def measure(url: str, events: int, repetitions: int) -> list[Figure]:
    """Every side, ``repetitions`` interleaved rounds; a figure per side, against plain."""
    poll = queries_for("public")["fetch_batch"].decode()
    # The poll by the raw sweep too: the variants' baseline, with the same client.
    queries = {"poll, raw": poll, "plain": PLAIN, "plain + outputs": PLAIN_OUTPUTS}
    queries |= {name: rewrite(poll, swaps) for name, swaps in VARIANTS.items()}

    def store_sweep(conn: psycopg.Connection[Any]) -> int:
        return unfiltered(OutboxStore(conn), BATCH)

    sweeps = {"poll": store_sweep} | {name: _raw_sweep(q) for name, q in queries.items()}
    walls: dict[str, list[float]] = {name: [] for name in sweeps}
    sides = {name: backend_cpu_side(url, events, name, s, walls) for name, s in sweeps.items()}
    cpu = interleave(sides, repetitions, before_each=lambda: settle(url, 1.0))
    details = {"events": events, "types": TYPES, "batch_size": BATCH}
    return [
        figure
        for name, samples in cpu.items()
        for figure in (
            Figure.of("fetch_cost", f"Postgres CPU us/row, {name}", samples, "us",
                      cpu.get("plain"), "plain", None, details),
            Figure.of("fetch_cost", f"fetch wall us/row, {name}", Samples(tuple(walls[name])),
                      "us", None, None, None, details),
        )
    ]  # fmt: skip


def rewrite(text: str, swaps: tuple[tuple[str, str], ...]) -> str:
    """``text`` with each old replaced by its new, whitespace runs matching any run."""
    for old, new in swaps:
        pattern = r"\s+".join(re.escape(word) for word in old.split())
        text, found = re.subn(pattern, new.replace("\\", "\\\\"), text)
        if not found:
            raise ValueError(f"not in the query: {old[:60]!r}")
    return text


class _BytesLoader(Loader):
    """jsonb as its binary bytes: the client then does next to nothing per row."""

    format = Format.BINARY

    def load(self, data: Any) -> bytes:
        return bytes(data)


def _raw_sweep(query: str) -> Callable[[psycopg.Connection[Any]], int]:
    """Every row by ``query`` in batches of BATCH, binary and prepared; the rows read."""

    def sweep(conn: psycopg.Connection[Any]) -> int:
        conn.adapters.register_loader("jsonb", _BytesLoader)
        params: dict[str, Any] = {"transaction_id": 0, "position": 0, "limit": BATCH,
                                  "max_bytes": MAX_BYTES, "max_row_bytes": MAX_ROW_BYTES,
                                  "part": 0, "parts": 1}  # fmt: skip
        fetched = 0
        with conn.cursor(binary=True) as cur:
            while True:
                rows = cur.execute(query.encode(), params, prepare=True).fetchall()
                fetched += len(rows)
                if len(rows) < BATCH:
                    return fetched
                tx, params["position"] = rows[-1][0], rows[-1][1]
                # An xid8 comes back as its 8 bytes (psycopg has no loader for it).
                params["transaction_id"] = tx if isinstance(tx, int) else int.from_bytes(tx)

    return sweep
