-- When the database recorded each row (issue #47, medium 2). Lag and stall were the age
-- of the oldest pending row's occurred_at, which writers may set: one row dated
-- 2999-01-01 at the head of a backlog kept outbox_relay_lag_seconds and
-- outbox_relay_publish_stalled_seconds at 0 while events waited. recorded_at is the
-- start of the INSERT statement that wrote the row, by the database's clock; the lag
-- queries read it, never occurred_at (relay/ops/lag.py).
--
-- A stable default, so adding the column rewrites nothing: rows already in the outbox
-- read as recorded when this migration ran. Writers get no INSERT on the column
-- (roles.sql grants them the event's columns only); for a role that holds INSERT on
-- every column (the owner, an older grant), a trigger replaces what it gives, as
-- outbox_assign_order_key does for the ordering key. Its WHEN keeps it off the honest
-- write path: the default already equals statement_timestamp().

ALTER TABLE {schema}.outbox
    ADD COLUMN recorded_at timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp();

CREATE FUNCTION {schema}.outbox_assign_recorded_at() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.recorded_at := pg_catalog.statement_timestamp();
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.outbox_assign_recorded_at() FROM PUBLIC;

CREATE TRIGGER outbox_assign_recorded_at
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.recorded_at IS DISTINCT FROM pg_catalog.statement_timestamp())
    EXECUTE FUNCTION {schema}.outbox_assign_recorded_at();

-- Retention reads the same clock: a published row goes once the database recorded it
-- longer ago than the retention. By occurred_at, a row dated 2999 stayed for good and
-- one dated 1970 went as soon as every subscriber had published it, before a replay
-- of the retention's window could read it.
CREATE OR REPLACE FUNCTION {schema}.outbox_prune(older_than_s double precision, batch_size integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    bound record;
    deleted bigint;
BEGIN
    IF older_than_s IS NULL OR older_than_s < 0 OR batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_prune: older_than_s must be >= 0 and batch_size >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The oldest part checkpoint of all subscribers: every row at or before it is
    -- published for everyone (none when there is no subscriber: prune nothing).
    SELECT c.transaction_id, c.position INTO bound FROM {schema}.outbox_checkpoints c
     ORDER BY c.transaction_id, c.position
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    WITH doomed AS (
        SELECT o.ctid FROM {schema}.outbox o
         WHERE (o.transaction_id, o.position) <= (bound.transaction_id, bound.position)
           AND o.recorded_at < pg_catalog.now() - pg_catalog.make_interval(secs => older_than_s)
           AND (o.aggregate_version IS NULL OR EXISTS (
                 SELECT 1 FROM {schema}.outbox n
                  WHERE n.aggregate_type = o.aggregate_type AND n.aggregate_id = o.aggregate_id
                    AND n.aggregate_version = o.aggregate_version + 1))
           -- A dead letter not yet redriven: redrive reads its event here.
           AND NOT EXISTS (
                 SELECT 1 FROM {schema}.outbox_dead_letters d
                  WHERE d.transaction_id = o.transaction_id AND d.position = o.position
                    AND d.redriven_at IS NULL)
         ORDER BY o.transaction_id, o.position
         LIMIT batch_size
    )
    DELETE FROM {schema}.outbox WHERE ctid IN (SELECT ctid FROM doomed);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;
