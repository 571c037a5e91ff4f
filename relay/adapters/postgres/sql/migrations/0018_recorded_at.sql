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
