-- Idempotency keys per writer (issue #47, "idempotency-key squatting"; docs/design.md §7).
-- A key was unique per aggregate: a writer that used another writer's key first made the
-- other's append write nothing and return the squatter's message id, and only the
-- squatter's event was published. A key now belongs to the role that wrote it.

-- 1. Who wrote each row: the inserting role (CURRENT_USER), never a value the writer
-- gives. `grant` gives writer roles no INSERT on it, and a role that may name it (the
-- owner, a role granted INSERT on the whole table) has its value replaced below. Rows
-- written before this migration keep NULL: no rewrite of the table, and their keys no
-- longer hold anyone's back (deploy/README.md, "Upgrading: migration 0015"). Added
-- without a default first, so that those rows read NULL rather than the migrating role.
ALTER TABLE {schema}.outbox ADD COLUMN writer text;
ALTER TABLE {schema}.outbox ALTER COLUMN writer SET DEFAULT CURRENT_USER;

-- Not SECURITY DEFINER: CURRENT_USER must be the inserting role. Its WHEN clause keeps it
-- off the honest write path, as outbox_assign_order_key's does: a defaulted row already
-- holds CURRENT_USER. (Inside a SECURITY DEFINER function, such as the Debezium copy,
-- CURRENT_USER is the function's owner, in the default and here alike.)
CREATE FUNCTION {schema}.outbox_assign_writer() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.writer := CURRENT_USER;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_assign_writer
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW WHEN (NEW.writer IS DISTINCT FROM CURRENT_USER)
    EXECUTE FUNCTION {schema}.outbox_assign_writer();

-- 2. A key is unique per writer and aggregate. Statements that name the old conflict
-- target, ON CONFLICT (aggregate_type, aggregate_id, idempotency_key), no longer find an
-- index: the write API and docs/writing-events.md say ON CONFLICT DO NOTHING, which
-- works before this migration and after. The widest entry (255 + 1024 + 1024 bytes
-- and a role name of at most 63) stays below the B-tree limit of 2704 bytes.
DROP INDEX {schema}.outbox_idempotency_key;
CREATE UNIQUE INDEX outbox_idempotency_key
    ON {schema}.outbox (aggregate_type, aggregate_id, idempotency_key, writer)
    WHERE idempotency_key IS NOT NULL;

-- 3. What a retry compares (the write API raises when a key comes back with another
-- event): the caller's own keyed events, payloads included. Writers may not read the
-- outbox's payloads (migration 0008); through this view a role reads only the rows it
-- wrote. CURRENT_USER in a view is the querying role. security_barrier: the caller's
-- own conditions never see another writer's row. Granted to PUBLIC, as it shows a role
-- nothing but its own rows, so a writer's retries work from this migration on, before
-- `grant` runs again (which grants it to the writer role too).
CREATE VIEW {schema}.outbox_own_keys WITH (security_barrier) AS
SELECT o.message_id, o.aggregate_type, o.aggregate_id, o.idempotency_key, o.event_type,
       o.payload
  FROM {schema}.outbox o
 WHERE o.idempotency_key IS NOT NULL AND o.writer = CURRENT_USER;

GRANT SELECT ON {schema}.outbox_own_keys TO PUBLIC;
