-- The part indexes (relay/adapters/postgres/part_index.py, docs/design.md §1, "Parts"): for a subscriber of
-- {parts} parts, one partial index per part, over the primary key's columns. A part's
-- poll (fetch_batch, planned with its part as a constant) then reads its own rows only,
-- instead of every row of the range. CONCURRENTLY: writers never wait for them.

-- name: create
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON {schema}.outbox (transaction_id, position)
 WHERE {schema}.outbox_part(aggregate_id, {parts}) = {part}

-- name: drop
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}
