-- A subscriber of one aggregate type (one topic per type, as Debezium's Outbox Event
-- Router routes) reads only its own rows, in publication order, through this index
-- instead of every row of the range (docs/design.md §1, "Filtered subscribers").
-- Built in the migration's transaction: writers wait while it builds, which on a large
-- outbox can take a while. IF NOT EXISTS: a DBA may build it beforehand, CONCURRENTLY
-- (deploy/README.md, "Upgrading: migration 0007").
CREATE INDEX IF NOT EXISTS outbox_aggregate_type_order
    ON {schema}.outbox (aggregate_type, transaction_id, position);
