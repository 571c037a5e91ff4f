-- The relay's fetches (docs/design.md §1, §7): one query per shape of subscriber, chosen
-- once per selection by relay/adapters/postgres/fetch_plan.py. The rules they share (what a
-- row counts, what comes back of it) are the fragments of fetch_rules.sql, named in braces.

-- name: fetch_batch
-- The heart of the relay (docs/design.md §1): rows of transactions whose fate is decided
-- (below the oldest running xid) after the checkpoint, in (transaction_id, position)
-- order. A keyset range scan on the primary key. With several parts, each part takes
-- the rows whose aggregate_id hashes to it, so one key always stays in one part.
-- At most %(limit)s rows, and no more once the rows so far reach %(max_bytes)s; always
-- at least one row. A row over %(max_row_bytes)s is not fetched (fetched_columns).
-- Two cuts: the running sum of the stored sizes first (stored_bytes), then the running
-- sum of what each row counts (counted_bytes).
-- For a subscriber without filters; fetch_batch_filtered and fetch_batch_of_type serve
-- the others.
-- ORDER BY names the xid8 column: sorting by the bigint output would be a full sort of
-- the backlog on every poll instead of an index scan.
SELECT {fetched_columns}
  FROM (SELECT m.*, pg_catalog.sum(m.counted_bytes)
                        OVER (ORDER BY m.transaction_id, m.position ROWS UNBOUNDED PRECEDING)
                        AS running_bytes
          FROM (SELECT r.*, {counted_bytes}
                  FROM (SELECT s.*, {row_bytes}
                          FROM (SELECT o.*, {stored_bytes} AS stored_bytes,
                                       pg_catalog.sum({stored_bytes})
                                           OVER (ORDER BY o.transaction_id, o.position
                                                 ROWS UNBOUNDED PRECEDING) AS running_stored
                                  FROM {schema}.outbox o
                                 WHERE (o.transaction_id, o.position)
                                       > (%(transaction_id)s::text::xid8, %(position)s)
                                   AND o.transaction_id < pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
                                   AND (%(parts)s = 1
                                        OR {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) = %(part)s)
                                 ORDER BY o.transaction_id, o.position
                                 LIMIT %(limit)s) AS s
                         WHERE s.running_stored - s.stored_bytes < %(max_bytes)s
                         -- Sorted already: saying so spares the window a sort. OFFSET 0
                         -- fences it: each row is measured once, not once per use.
                         ORDER BY s.transaction_id, s.position
                        OFFSET 0) AS r) AS m) AS b
 WHERE b.running_bytes - b.counted_bytes < %(max_bytes)s
 ORDER BY b.transaction_id, b.position;

-- name: fetch_batch_filtered
-- fetch_batch for a subscriber with filters that the index of fetch_batch_of_type does
-- not serve (event types, several aggregate types). It reads what fetch_batch reads
-- (with the same two cuts, and rows too large to fetch as in fetch_batch); of those,
-- only the rows the subscriber's filters keep come back. Every row says how far the
-- read went (read_*) and whether it came back full; when the filters keep none, one row
-- of NULLs says it. Nothing read: no row. (Slower than fetch_batch per row read, about
-- 3x on the server, so subscribers without filters do not use it.)
WITH w AS (
    SELECT o.*, {stored_bytes} AS stored_bytes,
           pg_catalog.sum({stored_bytes})
               OVER (ORDER BY o.transaction_id, o.position ROWS UNBOUNDED PRECEDING)
               AS running_stored,
           pg_catalog.row_number() OVER (ORDER BY o.transaction_id, o.position) AS n
      FROM {schema}.outbox o
     WHERE (o.transaction_id, o.position) > (%(transaction_id)s::text::xid8, %(position)s)
       AND o.transaction_id < pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
       AND (%(parts)s = 1 OR {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) = %(part)s)
     ORDER BY o.transaction_id, o.position
     LIMIT %(limit)s
), measured AS MATERIALIZED (  -- each row measured once, not once per use
    SELECT s.*, {row_bytes}
      FROM w AS s
     WHERE s.running_stored - s.stored_bytes < %(max_bytes)s
     ORDER BY s.transaction_id, s.position
), kept AS (
    SELECT c.* FROM (
        SELECT m.*, pg_catalog.sum(m.counted_bytes)
                        OVER (ORDER BY m.transaction_id, m.position ROWS UNBOUNDED PRECEDING)
                        AS running_bytes
          FROM (SELECT r.*, {counted_bytes}
                  FROM measured AS r) AS m) AS c
     WHERE c.running_bytes - c.counted_bytes < %(max_bytes)s
)
SELECT last.transaction_id::text::bigint AS read_transaction_id, last.position AS read_position,
       last.n = %(limit)s OR last.n < (SELECT pg_catalog.count(*) FROM w) AS read_full,
       {fetched_columns}
  FROM (SELECT k.transaction_id, k.position, k.n FROM kept AS k
         ORDER BY k.transaction_id DESC, k.position DESC LIMIT 1) AS last
  LEFT JOIN LATERAL (
       SELECT * FROM kept AS k
        WHERE (%(aggregate_types)s::text[] IS NULL OR k.aggregate_type = ANY(%(aggregate_types)s::text[]))
          AND (%(event_types)s::text[] IS NULL OR k.event_type = ANY(%(event_types)s::text[]))) AS b
    ON true
 ORDER BY b.transaction_id, b.position;

-- name: fetch_batch_of_type
-- fetch_batch for a subscriber of one aggregate type: a range scan of
-- outbox_aggregate_type_order reads only that type's rows (with fetch_batch's two cuts,
-- and rows too large to fetch as there). A fetch that comes back short has read every
-- decided row of the type, so the read went up to the horizon (read_transaction_id,
-- position 0) if any row at all was written in between; no row of NULLs otherwise, so
-- an idle part writes no checkpoint.
SELECT h.horizon::text::bigint AS read_transaction_id, 0::bigint AS read_position,
       h.anything AS read_any,
       {fetched_columns}
  FROM (SELECT pg_catalog.pg_snapshot_xmin(s) AS horizon, %(aggregate_type)s::text AS aggregate_type,
               -- The newest decided row, by a backward scan (not EXISTS: see
               -- newest_decided), lies after the checkpoint.
               coalesce((SELECT (a.transaction_id, a.position)
                                  > (%(transaction_id)s::text::xid8, %(position)s)
                           FROM {schema}.outbox a
                          WHERE a.transaction_id < pg_catalog.pg_snapshot_xmin(s)
                          ORDER BY a.transaction_id DESC, a.position DESC LIMIT 1),
                        false) AS anything
          FROM pg_catalog.pg_current_snapshot() AS s
         -- OFFSET 0 fences it: flattened, the backward scan ran once per row returned
         -- (read_any is in every row), a thousand index descents per batch.
        OFFSET 0) AS h
  LEFT JOIN LATERAL (
       SELECT c.* FROM (
           SELECT m.*, pg_catalog.sum(m.counted_bytes)
                           OVER (ORDER BY m.aggregate_type, m.transaction_id, m.position ROWS UNBOUNDED PRECEDING)
                           AS running_bytes
             FROM (SELECT r.*, {counted_bytes}
                     FROM (SELECT s.*, {row_bytes}
                             FROM (SELECT o.*, {stored_bytes} AS stored_bytes,
                                          pg_catalog.sum({stored_bytes})
                                              OVER (ORDER BY o.aggregate_type, o.transaction_id, o.position
                                                    ROWS UNBOUNDED PRECEDING) AS running_stored
                                     FROM {schema}.outbox o
                                    -- The type's rows after the checkpoint and below
                                    -- the horizon, as the bounds of one range of the
                                    -- type's index. No equality on the type: then only
                                    -- that index gives the order asked for, and no plan
                                    -- reads the primary key's range, every type's rows
                                    -- (the planner's choice when it guessed, from the
                                    -- checkpoint, a row or so to read: 100x the rows).
                                    -- The bounds come from h and the limit from a
                                    -- sub-select: the planner's guess then ignores the
                                    -- checkpoint, and it reckons on reading a tenth of
                                    -- the rows, so no bitmap of all the type's rows and
                                    -- a sort beats the range scan that stops at the
                                    -- limit. (In the ORDER BYs, one type: no cost.)
                                    WHERE (o.aggregate_type, o.transaction_id, o.position)
                                          > (h.aggregate_type, %(transaction_id)s::text::xid8, %(position)s)
                                      AND (o.aggregate_type, o.transaction_id) < (h.aggregate_type, h.horizon)
                                      AND (%(parts)s = 1
                                           OR {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) = %(part)s)
                                      AND (%(event_types)s::text[] IS NULL
                                           OR o.event_type = ANY(%(event_types)s::text[]))
                                    ORDER BY o.aggregate_type, o.transaction_id, o.position
                                    LIMIT (SELECT %(limit)s::bigint)) AS s
                            WHERE s.running_stored - s.stored_bytes < %(max_bytes)s
                            ORDER BY s.aggregate_type, s.transaction_id, s.position
                           OFFSET 0) AS r) AS m) AS c
        WHERE c.running_bytes - c.counted_bytes < %(max_bytes)s) AS b
    ON true
 WHERE h.anything
 ORDER BY b.transaction_id, b.position;
