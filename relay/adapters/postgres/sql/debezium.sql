-- Debezium Outbox Event Router compatibility (run by `outbox-relay debezium attach`).
-- Apps keep inserting into their Debezium-style table; a trigger copies each row, in the
-- same transaction, into the relay's outbox, so the relay's ordering guarantees apply.
-- Apps that delete the row right after inserting it (common with Debezium) lose nothing:
-- the copy is made on INSERT.
-- {schema}: the relay's schema; {source}: the Debezium table ({source_name}: its name as
-- a literal); {trigger}/{update_trigger}: trigger names; {options}: the table's router
-- options as JSON (relay/ops/debezium.py).

-- name: schema_of
-- The schema of a table the operator named without one, as the role's own search_path
-- finds it (run under that path: relay/adapters/postgres/db.py, role_search_path).
SELECT n.nspname
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = pg_catalog.to_regclass(%(table)s::text);

-- name: columns
-- The source table's columns and their types (attach checks the options against them).
SELECT a.attname, a.attnotnull, t.typname
  FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
 WHERE a.attrelid = %(table)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum;

-- name: register
-- The table's router options, where the shared copy function (outbox_from_debezium,
-- migration 0008) reads them: only the owner writes this registry, so no other role can
-- choose a copy's topic or headers. Entries of tables dropped since are cleared.
DELETE FROM {schema}.outbox_debezium_tables d
 WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = d.source);
INSERT INTO {schema}.outbox_debezium_tables (source, options)
VALUES ({source_name}::regclass, {options}::jsonb)
ON CONFLICT (source) DO UPDATE SET options = excluded.options, attached_at = pg_catalog.now();

-- name: attach
DROP TRIGGER IF EXISTS {trigger} ON {source};
CREATE TRIGGER {trigger} AFTER INSERT ON {source}
    FOR EACH ROW EXECUTE FUNCTION {schema}.outbox_from_debezium();
DROP TRIGGER IF EXISTS {update_trigger} ON {source};

-- name: attach_fatal_updates
-- table.op.invalid.behavior=fatal: an UPDATE is copied as an event that stops the relay.
CREATE TRIGGER {update_trigger} AFTER UPDATE ON {source}
    FOR EACH ROW EXECUTE FUNCTION {schema}.outbox_from_debezium();

-- name: detach
-- Inserts into the table no longer reach the outbox; its options are forgotten.
DROP TRIGGER IF EXISTS {trigger} ON {source};
DROP TRIGGER IF EXISTS {update_trigger} ON {source};
DELETE FROM {schema}.outbox_debezium_tables WHERE source = {source_name}::regclass;

-- name: drop_old_function
-- Before 0.2, attach made one function per table; the shared one replaces it.
DROP FUNCTION IF EXISTS {schema}.{old_function}();

-- name: publication
-- The Debezium connector's publication: does it list tables (it must, for a cut-over)?
SELECT p.puballtables,
       EXISTS (SELECT FROM pg_publication_rel r
                WHERE r.prpubid = p.oid AND r.prrelid = %(table)s::regclass)
  FROM pg_publication p WHERE p.pubname = %(publication)s;

-- name: cut_over
-- The cut-over from a running Debezium (deploy/README.md): in the transaction that
-- creates the trigger, wait for the app's writers in flight and hold new ones back for a
-- moment, then take the table out of Debezium's publication. Every row committed before
-- is Debezium's (its changes precede this commit in the WAL, where the table was still
-- published); every row committed after is copied to the relay, and Debezium's decoder,
-- reading past this commit, no longer sends it: none is lost, none is published twice.
LOCK TABLE {source} IN SHARE ROW EXCLUSIVE MODE;
ALTER PUBLICATION {publication} DROP TABLE {source};

-- name: wal_position
SELECT pg_catalog.pg_current_wal_lsn()::text;
