-- Per-key order is the database's order, and nothing on the write path but the INSERT.
--
-- 1. transaction_id becomes the row's ordering key:
--      greatest(the writer's xid, the xmax of the inserting statement's snapshot)
--    A writer that waited for another (a row lock, a unique or version constraint)
--    inserts in a statement that starts after the other committed, so its snapshot's
--    xmax is above every xid the other's rows could carry: it sorts after them, even
--    when it took its own xid earlier (ties go to the later position). The key is never
--    below the writer's xid, so the relay's horizon (transaction_id below
--    pg_snapshot_xmin) still proves nothing is skipped. A column default of built-in
--    functions: no trigger, no index, no extra read per row.
-- 2. The stream-order refusal (RLY02) goes: appends are now ordered by (1) instead.
-- 3. The NOTIFY trigger goes: pg_notify made every writer's commit take one global
--    lock. The relay probes for newly decided rows instead.

ALTER TABLE {schema}.outbox
    ALTER COLUMN transaction_id
    SET DEFAULT greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot()));

CREATE OR REPLACE FUNCTION {schema}.outbox_check_stream_order() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.aggregate_version = 1 THEN
        RETURN NEW;
    END IF;
    PERFORM FROM {schema}.outbox o
      WHERE o.aggregate_type = NEW.aggregate_type
        AND o.aggregate_id = NEW.aggregate_id
        AND o.aggregate_version = NEW.aggregate_version - 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stream %/% has no version %, cannot append version %',
            NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version - 1, NEW.aggregate_version
            USING ERRCODE = 'RLY01';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER outbox_notify ON {schema}.outbox;
DROP FUNCTION {schema}.outbox_notify();
