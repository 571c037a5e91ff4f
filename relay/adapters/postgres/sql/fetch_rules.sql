-- The rules every fetch of fetch.sql shares, written once. Each "-- name: x" block is a
-- fragment, not a query: relay/adapters/postgres/queries.py puts it where a query says
-- {x}, when the queries are rendered (once per schema). A fragment reads fixed aliases,
-- which every query that uses it gives its rows: o (the outbox's rows), s (the rows
-- kept by the first cut), r (those measured), b (those kept by the second cut).
-- Not a SQL function: a function with a pinned search_path is never inlined, and a call
-- per row would cost the poll more than the rule itself. Nor may a fragment end in a
-- comment: the query's text goes on after it.

-- name: stored_bytes
-- What a row of o holds on disk (compressed, or a TOAST pointer): free to read, so the
-- first cut runs on it, and only the rows it keeps are measured.
pg_catalog.pg_column_size(o.payload) + pg_catalog.pg_column_size(o.headers)

-- name: row_bytes
-- The size rule (docs/design.md §7, "Large rows"): what the relay would hold of a row of
-- s, every text column's bytes and each jsonb column's size uncompressed (its text, for
-- a compressed one; nothing else is decompressed to measure it).
pg_catalog.octet_length(s.aggregate_type)::bigint
+ pg_catalog.octet_length(s.aggregate_id) + pg_catalog.octet_length(s.event_type)
+ CASE WHEN pg_catalog.pg_column_compression(s.payload) IS NULL THEN pg_catalog.pg_column_size(s.payload)
       ELSE pg_catalog.octet_length(s.payload::text) END
+ CASE WHEN pg_catalog.pg_column_compression(s.headers) IS NULL THEN pg_catalog.pg_column_size(s.headers)
       ELSE pg_catalog.octet_length(s.headers::text) END
+ CASE WHEN s.debezium IS NULL THEN 0
       WHEN pg_catalog.pg_column_compression(s.debezium) IS NULL THEN pg_catalog.pg_column_size(s.debezium)
       ELSE pg_catalog.octet_length(s.debezium::text) END AS row_bytes

-- name: counted_bytes
-- Whether a row of r is too large to fetch, and what it counts towards max_bytes: a row
-- too large, its stored size; any other, what it measures, never less than its stored
-- size, so the first cut never drops a row the second keeps. An integer (capped at
-- 2^31 - 1, more than any record can hold), so the running sum is a bigint rather than
-- a slower numeric.
r.row_bytes > %(max_row_bytes)s AS too_large,
least(CASE WHEN r.row_bytes > %(max_row_bytes)s THEN r.stored_bytes
           ELSE greatest(r.row_bytes, r.stored_bytes) END,
      2147483647)::integer AS counted_bytes

-- name: fetched_columns
-- What a fetch returns of a row of b, in relay/adapters/postgres/fetch_plan.py's EVENT_COLUMNS
-- order. A row too large comes back as its identity only, its long text columns cut
-- short, and too_large_bytes says its size (the worker makes it poison).
-- The payload's JSON text as bytes: the relay loads a batch of them in one C loop.
-- Empty headers come back as NULL: parsing '{{}}' per row costs more than the payload.
-- occurred_at is clamped into what Python's datetime holds: a writer may store 'infinity'.
-- The "id" header's value as bytes (id_text): written here in a tenth of Python's time.
b.transaction_id::text::bigint AS transaction_id, b.position, b.message_id,
CASE WHEN b.too_large AND pg_catalog.octet_length(b.aggregate_type) > 200
     THEN pg_catalog.left(b.aggregate_type, 200) || '...[cut: ' || pg_catalog.octet_length(b.aggregate_type) || ' bytes]'
     ELSE b.aggregate_type END AS aggregate_type,
CASE WHEN b.too_large AND pg_catalog.octet_length(b.aggregate_id) > 200
     THEN pg_catalog.left(b.aggregate_id, 200) || '...[cut: ' || pg_catalog.octet_length(b.aggregate_id) || ' bytes]'
     ELSE b.aggregate_id END AS aggregate_id,
b.aggregate_version,
CASE WHEN b.too_large AND pg_catalog.octet_length(b.event_type) > 200
     THEN pg_catalog.left(b.event_type, 200) || '...[cut: ' || pg_catalog.octet_length(b.event_type) || ' bytes]'
     ELSE b.event_type END AS event_type,
CASE WHEN NOT b.too_large THEN pg_catalog.convert_to(b.payload::text, 'UTF8') END AS payload,
CASE WHEN NOT b.too_large THEN nullif(b.headers, '{{}}'::jsonb) END AS headers,
least(greatest(b.occurred_at, '0001-01-02 00:00+00'), '9999-12-30 00:00+00') AS occurred_at,
b.counted_bytes, CASE WHEN NOT b.too_large THEN b.debezium END AS debezium,
CASE WHEN b.too_large THEN b.row_bytes END AS too_large_bytes,
pg_catalog.convert_to(b.message_id::text, 'UTF8') AS id_text
