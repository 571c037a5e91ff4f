-- `verify --through projection` (relay/adapters/postgres/projection.py): the order
-- projection's tables (spark_jobs/order_projection.py), read where the job writes them.
-- Named queries; the tables are named unqualified, in the schema pin_sink_search_path
-- puts after pg_catalog.

-- name: role_search_path
-- The connecting role's own search_path back (its, its database's or the server's
-- setting), in place of the relay's pin (relay/adapters/postgres/db.py): the job's
-- connections start from it.
SELECT pg_catalog.set_config('search_path', s.reset_val, false)
  FROM pg_catalog.pg_settings s WHERE s.name = 'search_path';

-- name: pin_sink_search_path
-- Then the Spark sinks' own path (spark_jobs/postgres_sink.py, PIN_SEARCH_PATH):
-- pg_catalog, the role's schema (where the job created its tables), pg_temp.
SELECT pg_catalog.set_config(
    'search_path',
    pg_catalog.concat_ws(', ', 'pg_catalog',
                         pg_catalog.quote_ident(pg_catalog.current_schema()), 'pg_temp'),
    false);

-- name: projected_rows
-- One row per order, at the (transaction_id, position) of the last event applied.
SELECT order_id, transaction_id, position FROM orders;

-- name: quarantined_keys
-- The record keys of the events the projection could not apply (its error table).
SELECT DISTINCT key FROM spark_corrupt_records WHERE sink = %(sink)s AND key IS NOT NULL;
