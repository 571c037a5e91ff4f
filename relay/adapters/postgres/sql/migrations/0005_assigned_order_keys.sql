-- The outbox assigns every row's ordering key and position itself (issue #17, item 4;
-- docs/design.md, "Ordering"). A writer that owns the table, or holds INSERT on every
-- column, could set both: by naming transaction_id, and position with OVERRIDING
-- SYSTEM VALUE. A key below a subscriber's checkpoint was never published; a key of
-- 2^62 kept its row pending (and unpruned) for ever.
--
-- A BEFORE INSERT trigger replaces what the writer gave with what the defaults give.
-- Its WHEN clause keeps it off the honest write path: it fires only when the key is
-- not the one the column default computes in this statement, or when the position is
-- not the one this session's last nextval of the identity drew. A false alarm (an app
-- trigger inserting another outbox row first, say) only re-draws both: the recomputed
-- key comes from a later snapshot, so it is never smaller and never above the next
-- xid, and every guarantee of the design holds. INSERT only: relay-owned rewrites of
-- keys by UPDATE are not affected.
--
-- currval needs SELECT on the identity's sequence, which writers lack (the identity
-- default needs no privilege): granted to PUBLIC. It reveals only how many positions
-- were drawn. The function draws with nextval, hence SECURITY DEFINER, with a fixed
-- search_path.

GRANT SELECT ON SEQUENCE {schema}.outbox_position_seq TO PUBLIC;

CREATE FUNCTION {schema}.outbox_assign_order_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.transaction_id := greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot()));
    NEW.position := nextval(format('%I.outbox_position_seq', TG_TABLE_SCHEMA)::regclass);
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.outbox_assign_order_key() FROM PUBLIC;

CREATE TRIGGER outbox_assign_order_key
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.transaction_id IS DISTINCT FROM
              greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot()))
          OR NEW.position IS DISTINCT FROM currval('{schema}.outbox_position_seq'))
    EXECUTE FUNCTION {schema}.outbox_assign_order_key();
