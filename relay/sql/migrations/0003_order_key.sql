-- Per-key order is the database's order, and no commit-time lock on the write path.
--
-- 1. transaction_id becomes the row's ordering key: the writer's xid, raised to the
--    largest transaction_id among the aggregate's rows the insert can see. A writer
--    that waited for another (a row lock, a unique or version constraint) inserts after
--    that one committed, so it sees its rows and sorts after them, even when it took
--    its own xid earlier. The key is never below the writer's xid, so the relay's
--    horizon (transaction_id below pg_snapshot_xmin) still proves nothing is skipped;
--    it is never above an xid already handed out, so the horizon always passes it.
--    The key cannot be forged: the trigger sets it whatever the INSERT says.
-- 2. The stream-order refusal (RLY02) goes: appends are now ordered by (1) instead.
-- 3. The NOTIFY trigger goes: pg_notify made every writer's commit take one global
--    lock. The relay probes for newly decided rows instead.

-- IF NOT EXISTS: on a big outbox, operators build it CONCURRENTLY beforehand.
CREATE INDEX IF NOT EXISTS outbox_aggregate_order
    ON {schema}.outbox (aggregate_type, aggregate_id, transaction_id);

CREATE FUNCTION {schema}.outbox_order_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.transaction_id := greatest(
        pg_current_xact_id(),
        (SELECT o.transaction_id
           FROM {schema}.outbox o
          WHERE o.aggregate_type = NEW.aggregate_type
            AND o.aggregate_id = NEW.aggregate_id
          ORDER BY o.transaction_id DESC
          LIMIT 1));
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_order_key
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    EXECUTE FUNCTION {schema}.outbox_order_key();

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
